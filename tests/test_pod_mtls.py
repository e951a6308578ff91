"""mTLS on a real decode server's internal port, with certificates made at test time: a pod
of the right role gets in; no certificate, one from another CA, an expired one, or the
wrong role for the method is refused; KV pushed by anyone but a prefill rank never reaches
the engine; rotated files apply at the next connection. (The prefill port: tests/prefill.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.config import MtlsConfig
from baton.security.certificates import Authority
from baton.security.mtls import Mtls
from decode.decode_servers import (
    collect,
    make_checkpoint,
    prefilled_handoff,
    push,
    reference_tokens,
    start_decode_server,
)

PROMPT = list(range(5, 45))
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mtls-model"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    authority = Authority.create("test CA")
    directory = tmp_path_factory.mktemp("pki")
    return authority, {role: authority.write(directory / role, role)
                       for role in ("decode", "gateway", "prefill")}


@pytest.fixture(scope="module")
def server(checkpoint, pki):
    _, roles = pki
    running, _ = start_decode_server(checkpoint, mtls=roles["decode"])
    yield running
    running.stop(0)


def stub(server, mtls: MtlsConfig) -> tuple[grpc.Channel, decode_pb2_grpc.DecodeStub]:
    channel = Mtls(mtls).channel(server.address, [])
    return channel, decode_pb2_grpc.DecodeStub(channel)


def stats_code(server, mtls: MtlsConfig) -> grpc.StatusCode:
    channel, decode = stub(server, mtls)
    with channel:
        try:
            decode.Stats(common_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_a_pod_with_a_certificate_of_the_ca_gets_in(server, pki):
    _, roles = pki
    assert stats_code(server, roles["gateway"]) == grpc.StatusCode.OK
    assert stats_code(server, roles["prefill"]) == grpc.StatusCode.OK


def test_callers_without_a_valid_client_certificate_are_refused(server, pki, tmp_path):
    _, roles = pki
    other = Authority.create("another CA").write(tmp_path / "other", "gateway")
    expired = pki[0].write(tmp_path / "expired", "gateway", expired=True)
    assert stats_code(server, MtlsConfig(insecure=True)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert stats_code(server, other) == grpc.StatusCode.UNAVAILABLE
    assert stats_code(server, expired) == grpc.StatusCode.UNAVAILABLE
    # TLS that checks the server but shows no certificate of its own
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(roles["gateway"].ca).read_bytes())
    with (grpc.secure_channel(server.address, credentials,
                              options=[("grpc.ssl_target_name_override", "baton.internal")]) as channel,
          pytest.raises(grpc.RpcError) as error):
        decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_only_prefill_ranks_push_kv_and_only_gateways_attach(server, checkpoint, pki):
    _, roles = pki
    handoff, chunks = prefilled_handoff(checkpoint, "injected", PROMPT, MAX_TOKENS)
    channel, as_gateway = stub(server, roles["gateway"])
    with channel, pytest.raises(grpc.RpcError) as error:
        push(as_gateway, handoff, chunks)  # KV injection by a gateway (or a client's) certificate
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "PushKV is for prefill pods" in error.value.details()
    assert server.worker.load.running_sequences == 0 and not server.worker._leases.awaiting

    channel, as_prefill = stub(server, roles["prefill"])
    with channel:
        assert push(as_prefill, handoff, chunks).request_id == "injected"
        with pytest.raises(grpc.RpcError) as error:  # a prefill rank cannot read the tokens
            collect(as_prefill.Attach(decode_pb2.AttachRequest(request_id="injected"), timeout=10))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as error:  # nor through a session
            list(as_prefill.Session(iter([decode_pb2.SessionCommand(
                stream=1, attach=decode_pb2.AttachRequest(request_id="injected"))]), timeout=10))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Session" in error.value.details()
    channel, as_gateway = stub(server, roles["gateway"])
    with channel:
        tokens, _ = collect(as_gateway.Attach(decode_pb2.AttachRequest(request_id="injected"),
                                              timeout=30))
    assert tokens == reference_tokens(checkpoint, PROMPT, MAX_TOKENS)


def test_rotated_certificates_apply_at_the_next_connection_without_a_restart(checkpoint, tmp_path):
    first = Authority.create("first CA")
    served = first.write(tmp_path / "served", "decode")
    running, _ = start_decode_server(checkpoint, mtls=served)
    try:
        old_client = first.write(tmp_path / "old", "gateway")
        assert stats_code(running, old_client) == grpc.StatusCode.OK
        second = Authority.create("second CA")  # the Secret is replaced: a new CA and certificate
        rotated = second.write(tmp_path / "rotated", "decode")
        for name in ("ca", "cert", "key"):
            Path(getattr(served, name)).write_bytes(Path(getattr(rotated, name)).read_bytes())
        new_client = second.write(tmp_path / "new", "gateway")
        assert stats_code(running, new_client) == grpc.StatusCode.OK
        assert stats_code(running, old_client) == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(0)


def test_a_service_without_certificates_refuses_to_start_unless_told_plaintext():
    with pytest.raises(ValueError, match="--mtls-insecure"):
        Mtls(MtlsConfig()).check_service("decode")
    Mtls(MtlsConfig(insecure=True)).check_service("decode")
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(MtlsConfig(), ca="ca.crt")


def test_the_gateways_public_tls_takes_a_renewed_certificate_without_a_restart(checkpoint, tmp_path):
    from baton.api.v1 import api_pb2, api_pb2_grpc
    from baton.config import GatewayServiceConfig, HttpConfig, ModelSourceConfig, ServerConfig
    from baton.gateway.server import create_server
    from baton.routing import InMemoryStore

    first = Authority.create("public CA 1").write(tmp_path / "one", "gateway")
    config = GatewayServiceConfig(
        server=ServerConfig(listen="127.0.0.1:0", tls_cert=first.cert, tls_key=first.key),
        model=ModelSourceConfig(path=str(checkpoint)), http=HttpConfig(port=0))
    gateway, port = create_server(config, store=InMemoryStore())

    def models(ca_path: str) -> grpc.StatusCode:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_path).read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=[
                ("grpc.ssl_target_name_override", "baton.internal")]) as channel:
            try:
                api_pb2_grpc.BatonStub(channel).ListModels(api_pb2.ListModelsRequest(), timeout=5)
            except grpc.RpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    try:
        assert models(first.ca) == grpc.StatusCode.OK  # no client certificate asked for
        second = Authority.create("public CA 2").write(tmp_path / "two", "gateway")
        Path(first.cert).write_bytes(Path(second.cert).read_bytes())
        Path(first.key).write_bytes(Path(second.key).read_bytes())
        assert models(second.ca) == grpc.StatusCode.OK
        assert models(first.ca) == grpc.StatusCode.UNAVAILABLE  # the old certificate is gone
    finally:
        gateway.stop(0)
