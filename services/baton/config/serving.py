"""What every server shares: its gRPC server, streams, the routing store, mTLS, and the
gateway's HTTP API and API keys."""

from __future__ import annotations

from baton.configtree import require, setting, settings


@settings("")
class ServerConfig:
    listen: str = setting("127.0.0.1:0", "host:port the gRPC server binds (port 0 = any free port)")
    advertise: str = setting("", "address peers use to reach this server; empty = the bound address")
    metrics_port: int = setting(0, "Prometheus metrics port (/metrics, and /healthz for probes); 0 = off",
                                minimum=0, maximum=65535)
    metrics_host: str = setting("127.0.0.1", "address the metrics port binds (the pod's IP in a cluster)")
    grace_s: float = setting(30.0, "seconds in-flight calls get to finish on SIGTERM (a draining pod takes "
                             "nothing new meanwhile)", minimum=0)
    tls_cert: str = setting("", "PEM certificate chain for TLS (e.g. /etc/baton/tls/tls.crt); empty = plaintext")
    tls_key: str = setting("", "PEM private key matching tls_cert (e.g. /etc/baton/tls/tls.key)")
    max_streams: int = setting(4096, "calls the server takes at once (each an event-loop coroutine, not "
                               "a thread); more get RESOURCE_EXHAUSTED", minimum=1)
    max_queued_requests: int = setting(1024, "requests waiting for their prefill (on a decode pod, or in "
                                       "a chain's queue); more get RESOURCE_EXHAUSTED", minimum=1)
    max_message_mib: int = setting(16, "largest message a client may send, in MiB (a KV chunk is ~1 MiB; "
                                   "a text prompt is bounded far below); larger: RESOURCE_EXHAUSTED",
                                   minimum=1, maximum=1024)

    def __post_init__(self) -> None:
        require(bool(self.tls_cert) == bool(self.tls_key),
                f"tls_cert {self.tls_cert!r} and tls_key {self.tls_key!r} go together: set both or neither")
        _host, sep, port = self.listen.rpartition(":")
        require(bool(sep) and port.isdigit() and int(port) <= 65535,
                f"listen address {self.listen!r} is not host:port")


@settings("stream")
class StreamConfig:
    interval_ms: float = setting(0.0, "hold each stream's messages at least this far apart; the tokens "
                                 "generated meanwhile go as one message (fewer messages per token: "
                                 "less CPU at the decode pod, the gateway and the client). The first "
                                 "token and a stream's end never wait. 0 = a message every engine step",
                                 minimum=0, maximum=1000)


@settings("routing")
class RoutingConfig:
    redis_url: str = setting("", "Redis URL for routing state; empty = in-memory (one process only)")
    heartbeat_s: float = setting(1.0, "seconds between worker heartbeats", exclusive_minimum=0)
    worker_ttl_s: float = setting(5.0, "a worker without a heartbeat for this long leaves routing")
    request_ttl_s: float = setting(600.0, "how long the gateway remembers where a request lives",
                                   exclusive_minimum=0)
    prefix_ttl_s: float = setting(60.0, "a decode pod's prefix-cache events and snapshot leave the "
                                  "routing store this long after its last write (a live pod "
                                  "rewrites them at least every third of it)", exclusive_minimum=0)
    namespace: str = setting("baton", "prefix of every routing key in Redis (one per deployment)")
    redis_timeout_s: float = setting(1.0, "a Redis call taking longer counts as Redis being down",
                                     exclusive_minimum=0)
    view_refresh_s: float = setting(0.5, "the gateway re-reads the workers at most this often", minimum=0)

    def __post_init__(self) -> None:
        require(bool(self.namespace) and ":" not in self.namespace,
                f"routing namespace {self.namespace!r} must be non-empty and without ':'")
        require(self.worker_ttl_s > self.heartbeat_s,
                f"routing worker_ttl_s {self.worker_ttl_s} must exceed heartbeat_s {self.heartbeat_s}")


@settings("mtls")
class MtlsConfig:
    """Mutual TLS between pods (baton.security.mtls): one CA; each pod's certificate names its role."""

    ca: str = setting("", "PEM CA bundle that signs every internal certificate (e.g. "
                      "/etc/baton/mtls/ca.crt)")
    cert: str = setting("", "this pod's PEM certificate, common name baton-<role> (or "
                        "baton-internal), DNS name baton.internal; served and presented as client")
    key: str = setting("", "the PEM private key of cert")
    insecure: bool = setting(False, "plaintext, unauthenticated internal calls (only when asked: a "
                             "service without certificates refuses to start otherwise)")

    def __post_init__(self) -> None:
        given = [bool(self.ca), bool(self.cert), bool(self.key)]
        require(all(given) or not any(given),
                f"mtls ca {self.ca!r}, cert {self.cert!r} and key {self.key!r} go together: set all "
                f"three or none")


@settings("http")
class HttpConfig:
    """The gateway's OpenAI-compatible HTTP API, beside its gRPC one."""

    host: str = setting("127.0.0.1", "address the HTTP API binds (0.0.0.0 in a pod)")
    port: int = setting(8000, "port of the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /metrics); 0 = off",
                        minimum=0, maximum=65535)
    metrics_textfile: str = setting("", "a Prometheus text file (node_exporter's textfile format) "
                                    "whose samples GET /metrics adds to the gateway's own: `baton "
                                    "up --autoscale` writes the planner's targets there; empty = "
                                    "none")
    tool_call_parser: str = setting("", "the format the model writes tool calls in (vLLM's "
                                    "--tool-call-parser names); empty = the one its chat template "
                                    "teaches", choices=("", "hermes", "llama3_json", "mistral"))

    def __post_init__(self) -> None:
        require(bool(self.host), "http host must not be empty")


@settings("http")
class DecodeHttpConfig(HttpConfig):
    """A decode pod's own OpenAI door (the gateway's, over the pod's router): what makes the
    pod a Gateway API InferencePool endpoint. Off unless asked."""

    port: int = setting(0, "port of the decode pod's own OpenAI-compatible HTTP API "
                        "(/v1/completions, /v1/chat/completions, /v1/models, /health, and "
                        "/metrics with the pod's vLLM-named series); 0 = off",
                        minimum=0, maximum=65535)

    def __post_init__(self) -> None:
        HttpConfig.__post_init__(self)  # (the @settings wrapper runs only the class's own)


@settings("auth")
class AuthConfig:
    api_keys_file: str = setting("", "file of API keys clients must present (gRPC `authorization: "
                                 "Bearer KEY` metadata, HTTP Authorization header), one per line "
                                 "as `KEY` or `NAME KEY`; re-read when it changes; empty = no keys")
