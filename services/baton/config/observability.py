"""What every server tells about itself beyond metrics: its logs and its traces."""

from __future__ import annotations

from baton.configtree import setting, settings

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


@settings("log")
class LogConfig:
    level: str = setting("INFO", "the lowest level of log records written", choices=LOG_LEVELS)
    format: str = setting("text", "text = one readable line per record; json = one JSON object per "
                          "line (time, level, logger, message, and a request log's fields), for "
                          "log collectors", choices=LOG_FORMATS)
    requests: bool = setting(False, "one log line per request when it ends (logger baton.requests): "
                             "its id, route, outcome, token counts, TTFT and total time")


@settings("otlp")
class OtlpConfig:
    traces_endpoint: str = setting("", "OpenTelemetry collector to export traces to over OTLP/gRPC "
                                   "(host:port or http://host:port; vLLM's --otlp-traces-endpoint); "
                                   "a W3C traceparent from the caller (HTTP header or gRPC "
                                   "metadata) is honoured. Empty = no tracing (the SDK is not "
                                   "loaded). Needs the `tracing` extra")
