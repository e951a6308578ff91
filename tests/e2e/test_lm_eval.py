"""lm-eval-harness, the real evaluation client, against the cluster's OpenAI door: its
``local-completions`` model on a loglikelihood task and a generate-until task, and its
``local-chat-completions`` model on the generate-until task, each written to disk here.
The loglikelihoods it reads from baton's echoed log probabilities equal `transformers`'
on the shipped model, and the generations equal baton's own greedy ones."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from baton.model.hub import SHIPPED_MODEL_DIR

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

DOCS = [{"context": "import os\n\ndef main():\n", "choices": ["    pass\n", "    return 1\n", "x"],
         "answer": 0},
        {"context": "for i in range(10):\n", "choices": ["    print(i)\n", "    break\n", "!"],
         "answer": 0},
        {"context": "class Point:\n    def __init__(self, x, y):\n", "choices": [
            "        self.x = x\n", "        pass\n", "?"], "answer": 0}]
LOGLIKELIHOOD_TASK = """task: baton_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: baton_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[0]}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "choice.yaml").write_text(LOGLIKELIHOOD_TASK.format(data=data))
    (folder / "generate.yaml").write_text(GENERATE_TASK.format(data=data))
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder))


def evaluate(model: str, base_url: str, task_names: list[str], tasks, **extra) -> dict:
    model_args = {"model": SHIPPED_MODEL_DIR.name, "base_url": base_url, "tokenizer_backend": "huggingface",
                  "tokenizer": str(SHIPPED_MODEL_DIR), "num_concurrent": 2, "max_retries": 1,
                  **extra}
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=task_names,
                                   task_manager=tasks, log_samples=True, limit=None,
                                   apply_chat_template=model == "local-chat-completions")


def their_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """As lm-eval scores a pair: the context's trailing whitespace moves to the continuation."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logprobs[position - 1, whole[position]].item()
               for position in range(len(context_ids), len(whole)))


def test_local_completions_loglikelihoods_equal_transformers(cluster, tasks):
    results = evaluate("local-completions", f"{cluster.gateway_http_url}/completions",
                       ["baton_choice"], tasks)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL_DIR,
                                                               dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    samples = results["samples"]["baton_choice"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        doc = sample["doc"]
        ours = [response[0] for response in sample["filtered_resps"]]
        expected = [their_loglikelihood(theirs, tokenizer, doc["context"], choice)
                    for choice in doc["choices"]]
        assert ours == pytest.approx(expected, abs=1e-3)
    assert "acc,none" in results["results"]["baton_choice"]


@pytest.mark.parametrize("model, path", [("local-completions", "completions"),
                                         ("local-chat-completions", "chat/completions")])
def test_generate_until_answers_are_batons_greedy_text(cluster, client, tasks, model, path):
    results = evaluate(model, f"{cluster.gateway_http_url}/{path}", ["baton_generate"], tasks)
    samples = results["samples"]["baton_generate"]
    assert len(samples) == len(DOCS)
    generated = [sample["resps"][0][0] for sample in samples]
    assert all(isinstance(text, str) for text in generated)
    if model == "local-completions":  # the same greedy text the gRPC API gives
        from baton.api.requests import GenerateRequest
        from baton.sampling.params import SamplingParams

        for sample, text in zip(samples, generated):
            completion = client.generate(GenerateRequest(text=sample["doc"]["context"],
                                                         sampling=SamplingParams(temperature=0.0,
                                                                                 max_tokens=12)))
            assert text == completion.text.split("\n\n")[0]
    assert "exact_match,none" in results["results"]["baton_generate"]
