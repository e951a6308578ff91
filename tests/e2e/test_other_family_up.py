"""`baton up --model DIR` on a family other than the shipped Llama, through the OpenAI door:
a tiny random Qwen3 checkpoint (per-head q/k norms, an explicit head size) with a byte-level
tokenizer, served by real processes (a gateway, a decode pod, a two-rank chain), answers the
`openai` client's greedy completions with transformers' own tokens, on both routes."""

from __future__ import annotations

import pytest
import torch
from baton.local.cluster import LocalCluster
from baton.local.spec import ClusterSpec
from baton.serving import free_port
from commands.cli_checkpoint import save_byte_tokenizer
from e2e_cluster import WORKER_TTL_S, skip_without_cluster_parts
from hf_reference import save_random_hf_model, tiny_config

pytestmark = pytest.mark.slow
THRESHOLD = 48  # prompts this long go through the chain
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    skip_without_cluster_parts()
    directory = tmp_path_factory.mktemp("qwen3")
    hf_model = save_random_hf_model(tiny_config("qwen3"), directory, seed=4)
    save_byte_tokenizer(directory)
    spec = ClusterSpec(model_path=str(directory), decode_workers=1, chain_ranks=2,
                       prefill_threshold_tokens=THRESHOLD, chain_break_even=False,
                       heartbeat_s=0.5, worker_ttl_s=WORKER_TTL_S, gateway_http_port=free_port())
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("qwen3-logs")) as cluster:
        yield directory, hf_model, cluster


def transformers_tokens(hf_model, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("route, length", [("local", 20), ("chain", 90)])
def test_the_door_serves_a_qwen3_checkpoint_as_transformers_generates(qwen3, route, length):
    import openai

    directory, hf_model, cluster = qwen3
    api = openai.OpenAI(base_url=cluster.gateway_http_url, api_key="unused", max_retries=0, timeout=120)
    try:
        (model,) = api.models.list().data
        assert model.id == directory.name  # served under its directory's name
        prompt_ids = torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        completion = api.completions.create(
            model=model.id, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "prefill_route": route})
        choice = completion.choices[0]
        assert choice.model_extra["token_ids"] == transformers_tokens(hf_model, prompt_ids)
        assert completion.usage.completion_tokens == MAX_TOKENS
    finally:
        api.close()
