"""baton's Python clients against a gateway that wants an API key and serves TLS (a real gRPC
server on loopback): the key and the CA reach it from both clients; without them the
gateway's answer arrives as its status."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from baton.client import AsyncBatonClient, BatonClient
from baton.config import (
    AuthConfig,
    GatewayServiceConfig,
    HttpConfig,
    ModelSourceConfig,
    ServerConfig,
)
from baton.gateway.server import create_server
from baton.routing import InMemoryStore
from baton.security.certificates import INTERNAL_SERVER_NAME, Authority
from commands.cli_checkpoint import save_cli_checkpoint

KEY = "sk-client-1"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secured-gateway")
    keys = directory / "keys"
    keys.write_text(f"app {KEY}\n")
    tls = Authority.create("public CA").write(directory / "tls", "gateway")
    config = GatewayServiceConfig(
        server=ServerConfig(listen="127.0.0.1:0", tls_cert=tls.cert, tls_key=tls.key),
        model=ModelSourceConfig(path=str(save_cli_checkpoint(directory / "model"))),
        http=HttpConfig(port=0), auth=AuthConfig(api_keys_file=str(keys)))
    gateway, port = create_server(config, store=InMemoryStore())
    yield f"127.0.0.1:{port}", tls.ca
    gateway.stop(0)


def access(ca: str, **overrides) -> dict:
    return {"api_key": KEY, "tls_ca_file": ca, "tls_server_name": INTERNAL_SERVER_NAME, **overrides}


def test_the_blocking_client_brings_its_key_over_tls(secured):
    address, ca = secured
    client = BatonClient(address, **access(ca))
    try:
        assert [model.id for model in client.list_models()] == ["model"]
        assert "".join(client.tokenize("def f").pieces) == "def f"
        assert client.abort("no-such-request") is False
    finally:
        client.close()


def test_the_asyncio_client_brings_its_key_over_tls(secured):
    address, ca = secured

    async def run():
        async with AsyncBatonClient(address, **access(ca)) as client:
            return await client.list_models(), await client.tokenize("def f")

    models, tokenization = asyncio.run(run())
    assert [model.id for model in models] == ["model"]
    assert "".join(tokenization.pieces) == "def f"


@pytest.mark.parametrize("overrides, code", [
    ({"api_key": None}, grpc.StatusCode.UNAUTHENTICATED),
    ({"api_key": "sk-client-2"}, grpc.StatusCode.UNAUTHENTICATED),
    ({"tls_ca_file": None, "tls_server_name": None}, grpc.StatusCode.UNAVAILABLE),  # plaintext
])
def test_a_client_without_the_key_or_tls_gets_the_gateways_status(secured, overrides, code):
    address, ca = secured
    client = BatonClient(address, **access(ca, **overrides))
    try:
        with pytest.raises(grpc.RpcError) as error:
            client.list_models()
        assert error.value.code() == code
    finally:
        client.close()

    async def run():
        async with AsyncBatonClient(address, **access(ca, **overrides)) as aio:
            with pytest.raises(grpc.aio.AioRpcError) as aio_error:
                await aio.list_models()
            return aio_error.value.code()

    assert asyncio.run(run()) == code


def test_a_server_name_without_tls_is_refused_naming_it():
    with pytest.raises(ValueError, match="needs TLS"):
        BatonClient("127.0.0.1:1", tls_server_name=INTERNAL_SERVER_NAME)


def test_baton_generate_server_sends_api_key_and_tls_ca(secured):
    from baton.commands import generate

    address, ca = secured
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    with pytest.raises(ValueError, match="UNAUTHENTICATED"):
        generate.run(parser.parse_args(["--server", address, "--api-key", "sk-client-2",
                                        "--tls-ca", ca, "def f"]))
    with pytest.raises(ValueError, match="--tls-ca applies with --server only"):
        generate.run(parser.parse_args(["--tls-ca", ca, "def f"]))


def test_waiting_for_a_gateway_that_never_serves_ends_in_a_timeout_naming_it():
    address = "127.0.0.1:1"  # nothing listens there
    with pytest.raises(TimeoutError, match=f"{address} is not serving after 0.3 s"):
        BatonClient(address).wait_until_serving(timeout_s=0.3)

    async def run():
        async with AsyncBatonClient(address) as client:
            await client.wait_until_serving(timeout_s=0.3)

    with pytest.raises(TimeoutError, match=f"{address} is not serving after 0.3 s"):
        asyncio.run(run())
