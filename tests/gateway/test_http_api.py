"""The gateway's OpenAI HTTP API on a real aiohttp server beside its gRPC one (in-memory
routing store, no pods): API keys (401 / UNAUTHENTICATED, rotation without a restart),
readiness (503 with Retry-After), limits (429, 413), malformed bodies, and how request
bodies are read. Generation through real pods is in tests/e2e/test_http.py."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from baton.api.v1 import api_pb2, api_pb2_grpc, common_pb2
from baton.config import (
    AuthConfig,
    GatewayRoutingConfig,
    GatewayServiceConfig,
    HttpConfig,
    ModelSourceConfig,
    ServerConfig,
)
from baton.gateway.http import fields
from baton.gateway.http.protocol import BadParameter, chat_request, completion_request
from baton.gateway.server import create_server
from baton.routing import InMemoryStore
from baton.serving import free_port
from commands.cli_checkpoint import save_cli_checkpoint
from decode.decode_servers import start_decode_server
from test_servicer import wait_for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_cli_checkpoint(tmp_path_factory.mktemp("http-model"))


class Gateway:
    def __init__(self, checkpoint, keys_file: str = "", max_streams: int = 4096,
                 wait_s: float = 0.3, store=None, stall_s: float = 30.0,
                 metrics_textfile: str = "", served_model_name: tuple[str, ...] = ()) -> None:
        config = GatewayServiceConfig(
            server=ServerConfig(listen="127.0.0.1:0", max_streams=max_streams, max_message_mib=1),
            model=ModelSourceConfig(path=str(checkpoint), served_model_name=list(served_model_name)),
            gateway=GatewayRoutingConfig(reroute_wait_s=wait_s, stall_s=stall_s),
            http=HttpConfig(port=free_port(), metrics_textfile=metrics_textfile),
            auth=AuthConfig(api_keys_file=keys_file))
        self.server, self.grpc_port = create_server(config, store=store or InMemoryStore())
        self.url = f"http://127.0.0.1:{config.http.port}"

    def post(self, path: str, body: bytes | dict, headers: dict | None = None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self._open(urllib.request.Request(self.url + path, data=data, headers={
            "Content-Type": "application/json", **(headers or {})}))

    def get(self, path: str):
        return self._open(urllib.request.Request(self.url + path))

    @staticmethod
    def _open(request):
        """(status, JSON body, headers), whatever the status."""
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read()), response.headers
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read()), error.headers

    def close(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def gateway(checkpoint):
    running = Gateway(checkpoint)
    yield running
    running.close()


def test_without_a_live_pod_health_and_generation_are_503_with_retry_after(gateway):
    status, body, headers = gateway.get("/health")
    assert status == 503 and headers["Retry-After"] == "1"
    status, body, headers = gateway.post("/v1/completions", {"prompt": "def", "max_tokens": 2})
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "service_unavailable" and "no decode worker" in body["error"]["message"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413, "larger than 1048576 bytes"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "has no chat template"),
])
def test_malformed_and_oversized_bodies_get_their_status(gateway, body, status, words):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    got, answer, _ = gateway.post(path, body)
    assert got == status and words in answer["error"]["message"], answer


def test_unknown_paths_and_methods_answer_openai_error_bodies(gateway):
    status, body, _ = gateway.get("/v1/nothing")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body, _ = gateway.get("/v1/completions")
    assert status == 405


def test_metrics_add_the_samples_of_the_textfile_once_it_is_written(checkpoint, tmp_path):
    from baton.metrics import PlannerMetrics
    from baton.planner import parse_pod
    from prometheus_client import CollectorRegistry, write_to_textfile

    textfile = tmp_path / "planner.prom"
    gateway = Gateway(checkpoint, metrics_textfile=str(textfile))

    def scrape():
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=30) as response:
            return parse_pod("gateway", "gateway", response.read().decode())

    try:
        assert scrape().has("baton_gateway_requests_in_flight")
        assert not scrape().has("baton_planner_target_replicas")  # not written yet
        planner = PlannerMetrics(CollectorRegistry())
        planner.target_replicas.labels(role="decode").set(3)
        planner.replicas.labels(role="decode").set(2)
        write_to_textfile(str(textfile), planner.registry)
        samples = scrape()
        assert samples.value("baton_planner_target_replicas", role="decode") == 3
        assert samples.value("baton_replicas", role="decode") == 2
        assert samples.has("baton_gateway_requests_in_flight")
    finally:
        gateway.close()


def test_a_gateway_streaming_its_limit_refuses_more_with_429(checkpoint):
    full = Gateway(checkpoint, max_streams=1, wait_s=3.0)
    try:
        waiting = threading.Thread(target=full.post, args=("/v1/completions", {"prompt": "def"}))
        waiting.start()  # waits up to 3 s for a decode pod, holding the one stream
        try:
            wait_for(lambda: full.server.http.streams == 1)
            status, body, headers = full.post("/v1/completions", {"prompt": "def"})
            assert status == 429 and headers["Retry-After"] == "1"
            assert "limit (server.max_streams)" in body["error"]["message"]
        finally:
            waiting.join()
    finally:
        full.close()


def test_a_stop_returns_once_the_open_requests_are_answered_not_at_the_end_of_their_grace(checkpoint):
    """An open request (waiting for a decode pod) gives up when the gateway drains, and is
    answered; the stop waits for that answer, not for the grace it could have given."""
    gateway = Gateway(checkpoint, wait_s=120.0)
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(
        gateway.post("/v1/completions", {"prompt": "def"})))
    waiting.start()
    try:
        wait_for(lambda: gateway.server.http.streams == 1)
        started = time.monotonic()
        gateway.server.stop(grace_s=120.0)
        assert time.monotonic() - started < 60.0
    finally:
        waiting.join(30)
    status, body, _ = answers[0]
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert gateway.server.http.streams == 0


def test_api_keys_are_required_on_both_apis_and_a_rotated_file_applies_at_once(checkpoint, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nalice sk-alice-1\nsk-anonymous\n")
    secured = Gateway(checkpoint, keys_file=str(keys))
    try:
        def models(key):
            return openai.OpenAI(base_url=secured.url + "/v1", api_key=key, max_retries=0).models.list()

        assert models("sk-alice-1").data[0].object == "model"
        assert models("sk-anonymous").data
        for wrong in ("sk-alice-2", "sk-alice-1x", "sk-alice-"):
            with pytest.raises(openai.AuthenticationError) as error:
                models(wrong)
            assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
        status, _, _ = secured.post("/v1/completions", {"prompt": "def"})
        assert status == 401, "no Authorization header"
        assert secured.get("/health")[0] == 503, "health needs no key"

        with grpc.insecure_channel(f"127.0.0.1:{secured.grpc_port}") as channel:
            stub = api_pb2_grpc.BatonStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.ListModels(api_pb2.ListModelsRequest())
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.ListModels(api_pb2.ListModelsRequest(),
                                   metadata=[("authorization", "Bearer sk-alice-1")]).models

            keys.write_text("alice sk-alice-2\n")  # rotated: the old key is refused at once
            with pytest.raises(openai.AuthenticationError):
                models("sk-alice-1")
            assert models("sk-alice-2").data
            with pytest.raises(grpc.RpcError) as error:
                stub.ListModels(api_pb2.ListModelsRequest(),
                                metadata=[("authorization", "Bearer sk-alice-1")])
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        secured.close()


def test_only_the_key_that_sent_a_request_may_abort_it(checkpoint, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice\nbob sk-bob\n")
    store = InMemoryStore()
    decode_server, _ = start_decode_server(checkpoint, store=store)
    secured = Gateway(checkpoint, keys_file=str(keys), store=store, wait_s=10.0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{secured.grpc_port}") as channel:
            stub = api_pb2_grpc.BatonStub(channel)

            def as_(key):
                return [("authorization", f"Bearer {key}")]

            stream = stub.Generate(api_pb2.GenerateRequest(
                request_id="alices", token_ids=api_pb2.TokenIds(ids=[5] * 20),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)),
                metadata=as_("sk-alice"), timeout=60)
            next(stream)  # running on the decode pod
            with pytest.raises(grpc.RpcError) as error:
                stub.Abort(common_pb2.AbortRequest(request_id="alices"), metadata=as_("sk-bob"))
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert decode_server.worker.load.running_sequences == 1, "Bob's Abort changed nothing"
            assert stub.Abort(common_pb2.AbortRequest(request_id="alices"), metadata=as_("sk-alice")).found
            last = list(stream)[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_ABORTED
    finally:
        secured.close()
        decode_server.stop(0)


# --- reading request bodies ----------------------------------------------------------------------

def test_a_completion_body_reads_every_documented_field():
    read = completion_request({
        "model": "m", "prompt": [[5, 6, 7]], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "top_k": -1, "seed": 3, "stop": "\n\n", "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "stop_token_ids": [2],
        "n": 1, "logprobs": None, "echo": False, "repetition_penalty": 1.0, "user": "ignored",
        "compression": {"enabled": True, "keep_ratio": 0.7}})
    assert read.prompts == [(5, 6, 7)] and read.stream and read.include_usage
    sampling = read.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
            sampling.stop, sampling.stop_token_ids, sampling.ignore_eos) == (
        9, 0.5, 0.9, 0, 3, ["\n\n"], [2], True)
    assert (read.compression.enabled, read.compression.keep_ratio) == (True, 0.7)
    assert completion_request({"prompt": "x"}).sampling.max_tokens == 16  # OpenAI's default


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": ["a", ""]}, "prompt", "prompt[1] must be a non-empty string"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"prompt": [1, True]}, "prompt", "non-empty string or list of token ids"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "finite number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "stop": [1]}, "stop", "string or a list of non-empty strings"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", "must be in [-2.0, 2.0]"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "must be a finite number > 0"),
    ({"prompt": "x", "min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
    ({"prompt": "x", "logit_bias": {"7": 101}}, "logit_bias", "logit_bias values must be in"),
    ({"prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens", "must be <= 10"),
    ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids", "integers >= 0"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of 1 must be >= n 2"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of", "cannot stream"),
    ({"prompt": "x", "n": 129}, "n", "must be <= 128"),
    ({"prompt": ["a"] * 65, "n": 2}, "n", "130 generations in one request"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "must be <= 20"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "taken only with echo"),
    ({"prompt": "x", "compression": {"keep_ratio": 2}}, "compression", "keep_ratio must be in (0, 1]"),
    # structured outputs: one at a time, each valid
    ({"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", "give one of"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json", "guided_json:"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format", "is not one of"),
    ({"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice", "non-empty JSON list"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be >= 1"),
])
def test_a_bad_completion_field_is_named(body, param, words):
    with pytest.raises(BadParameter) as error:
        completion_request(body)
    assert error.value.param == param and words in str(error.value)


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {}}]), ("top_logprobs", 2),
    ("tool_choice", {"type": "function", "function": {"name": "unknown"}}),
    ("cache_salt", 7), ("priority", "high"), ("chat_template_kwargs", {"tools": []}),
    ("documents", "a document"),
])
def test_a_bad_chat_field_is_refused_by_name(field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(BadParameter) as error:
        chat_request(body)
    assert error.value.param.split("[")[0].split(".")[0] == field


def test_a_chat_body_reads_what_the_template_needs():
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "", "reasoning_content": "hm",
                          "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}],
            "continue_final_message": True, "add_generation_prompt": False,
            "chat_template": "{{ messages[-1].content }}",
            "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "d"}]}
    chat = chat_request(body)
    assert chat.continue_final_message and chat.chat_template == "{{ messages[-1].content }}"
    assert chat.template_kwargs == {"enable_thinking": False, "documents": [{"text": "d"}]}
    assert chat.messages[1]["tool_calls"][0]["function"]["name"] == "f"
    assert chat.messages[1]["reasoning_content"] == "hm" and chat.messages[2]["tool_call_id"] == "c1"
    with pytest.raises(BadParameter) as error:
        chat_request({**body, "add_generation_prompt": True})
    assert error.value.param == "continue_final_message"


def test_a_field_baton_does_not_read_is_accepted_with_one_warning_per_name(caplog, monkeypatch):
    monkeypatch.setattr(fields, "_warned", set())  # once per process: earlier tests sent some
    body = {"prompt": "x", "user": "u-1", "frobnicate": 1}
    with caplog.at_level("WARNING", logger="baton.gateway.http.fields"):
        completion_request(body)
        completion_request(body)
    warned = [record.getMessage() for record in caplog.records]
    assert len([m for m in warned if "'frobnicate'" in m]) == 1
    assert any("'user' has no effect here" in m for m in warned)
    # neutral values of unsupported fields pass quietly
    completion_request({"prompt": "x", "n": 1, "echo": False, "logprobs": None, "priority": 0,
                        "use_beam_search": False})


def test_a_chat_body_reads_text_parts_and_the_token_limit_aliases():
    read = chat_request({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 5})
    assert read.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert read.max_tokens == 5
    assert chat_request({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None
    for messages, words in (([], "non-empty list"), ([{"role": "wizard", "content": "x"}], "'wizard'"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts")):
        with pytest.raises(BadParameter) as error:
            chat_request({"messages": messages})
        assert error.value.param == "messages" and words in str(error.value)
    with pytest.raises(BadParameter, match="top_logprobs needs logprobs"):
        chat_request({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})


def test_served_model_names_are_listed_and_answered_and_any_other_name_is_404(checkpoint):
    """A model mounted at a directory of any name (the operator mounts every checkpoint at
    /models/current) is served under the names it is given, the first reported."""
    store = InMemoryStore()
    decode_server, _ = start_decode_server(checkpoint, store=store)  # registers the directory's name
    named = Gateway(checkpoint, served_model_name=("acme/coder-7b", "coder"), store=store, wait_s=10.0)
    try:
        client = openai.OpenAI(base_url=named.url + "/v1", api_key="none", max_retries=0)
        assert [model.id for model in client.models.list().data] == ["acme/coder-7b", "coder"]
        wait_for(lambda: named.get("/health")[0] == 200)  # the pod is routed to under any name
        answer = client.completions.create(model="coder", prompt="def f(", max_tokens=3, temperature=0)
        assert answer.model == "acme/coder-7b" and answer.usage.completion_tokens == 3
        assert client.models.retrieve("coder").id == "coder"
        for other in (checkpoint.name, "acme/other"):
            with pytest.raises(openai.NotFoundError, match="acme/coder-7b"):
                client.models.retrieve(other)
            with pytest.raises(openai.NotFoundError, match=f"unknown model '{other}'"):
                client.completions.create(model=other, prompt="def f(", max_tokens=2)
    finally:
        named.close()
        decode_server.stop(0)


def test_tokenize_detokenize_and_version_answer_at_the_gateway(gateway, checkpoint):
    """vLLM's bodies, answered without a pod: a prompt or chat messages to ids and back."""
    status, body, _ = gateway.post("/tokenize", {"prompt": "def main():"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 1024
    status, back, _ = gateway.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "def main():"}
    status, body, _ = gateway.post("/tokenize", {"prompt": "x", "model": "another"})
    assert status == 404 and "unknown model 'another'" in body["error"]["message"]
    status, body, _ = gateway.post("/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body, _ = gateway.get("/version")
    assert status == 200 and body["version"] == "0.1.0"


def test_a_completions_text_prompt_gets_the_tokenizers_bos_as_vllm_gives_it(tmp_path):
    """add_special_tokens: on by default for /v1/completions and /tokenize's prompt, off for
    chat (the template writes what the model needs)."""
    from tokenizers import Tokenizer, processors

    directory = save_cli_checkpoint(tmp_path / "bos-model")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tokenizer.token_to_id("d")  # any id of the tiny vocabulary stands in for <s>
    tokenizer.post_processor = processors.TemplateProcessing(single="d $A", special_tokens=[("d", bos)])
    tokenizer.save(str(directory / "tokenizer.json"))
    assert completion_request({"prompt": "x"}).add_special_tokens
    assert not chat_request({"messages": [{"role": "user", "content": "x"}]}).add_special_tokens
    with_bos = Gateway(directory)
    try:
        _, plain, _ = with_bos.post("/tokenize", {"prompt": "def", "add_special_tokens": False})
        _, body, _ = with_bos.post("/tokenize", {"prompt": "def"})
        assert body["tokens"] == [bos, *plain["tokens"]]
    finally:
        with_bos.close()


def test_the_architecture_doc_says_what_happens_to_every_field():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| field | endpoints | what baton does |"):]
    table = table[:table.index("\n\n")]
    named = set(fields.IGNORED)
    for endpoint in ("completions", "chat"):
        named |= set(fields.HONOURED[endpoint]) | set(fields.NEUTRAL[endpoint])
    missing = sorted(name for name in named if f"`{name}`" not in table)
    assert not missing, f"docs/architecture.md's field table does not name {missing}"
