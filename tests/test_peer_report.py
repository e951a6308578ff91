"""The peer benchmark's raw results and report (bench/peer/results.py, report.py, run.py):
the report is rendered from the compact results alone, and fp32 disagreement fails a run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "bench" / "peer"),
                str(Path(__file__).resolve().parents[1] / "bench")]
import report
import results as raw
from run import check_identical

REQUESTS = 4


def offline(system: str, wall_s: float, tokens: list[list[int]]) -> dict:
    """One runner's JSON result, as offline_baton.py / offline_vllm.py write it."""
    return raw.offline_run({"system": system, "dtype": "float32", "token_budget": 4096,
                            "max_seqs": 64, "load_s": 1.0, "wall_s": wall_s, "own_cpu_s": 2.0,
                            "others_cpu_s": 0.0, "generated_tokens": sum(map(len, tokens)),
                            "ttft_s": [0.1 * (i + 1) for i in range(len(tokens))],
                            "token_ids": tokens})


def served(wall_s: float, texts: list[str]) -> dict:
    """One scenario as served.vllm_bench returns it."""
    return raw.served_run({"wall_s": wall_s, "generated_tokens": 8 * len(texts),
                           "completed": len(texts), "output_lens": [8] * len(texts),
                           "ttft_s": [0.02] * len(texts), "itl_s": [[0.003] * 7] * len(texts),
                           "latency_s": [0.05] * len(texts), "texts": texts, "errors": [],
                           "others_cpu_s": 0.0, "cpu_by_role_s": {"client": 1.0}})


@pytest.fixture
def results(tmp_path) -> dict:
    tokens = [[i, i + 1] for i in range(REQUESTS)]
    texts = [f"text {i}" for i in range(REQUESTS)]
    setting = {"token_budget": 4096, "max_seqs": 64}
    sweep = [{**offline(system, 1.0, tokens), "asked": {"token_budget": 0, "max_seqs": 0}}
             for system in report.SYSTEMS]
    built = {"commit": "0123456789abcdef", "dirty": False, "started": "then", "finished": "later",
             "machine": "a test", "load_average_end": [0.5, 0.5, 0.5], "threads": 2,
             "workload": {"requests": REQUESTS, "sets": 1, "new_tokens": 2, "seed": 1},
             "vllm_environment": {"VLLM_CPU_KVCACHE_SPACE": "2"}, "sweep": sweep,
             "best": {"vllm": setting, "baton": setting},
             "offline": [{"dtype": "float32", "round": r,
                          "runs": {"vllm": offline("vllm", 2.0, tokens),
                                   "baton": offline("baton", 1.0 + r, tokens)}} for r in range(2)],
             "reference_text_digests": [[raw.digest(text) for text in texts]],
             "scenarios": [{"name": "c1", "max_concurrency": 1, "request_rate": float("inf"),
                            "set": 0, "describe": "concurrency 1"}],
             "served": [{"dtype": "float32", "round": r, "system": system, "setting": setting,
                         "load_s": 1.0, "scenarios": {"c1": served(wall_s, texts)}}
                        for r in range(2) for system, wall_s in (("vllm", 1.0), ("baton", 0.8))]}
    path = raw.save(built, tmp_path / "results.json.gz")
    return raw.load(path)


def test_the_report_is_rendered_from_the_saved_results(results):
    text = report.render(results)
    assert "commit `0123456789ab`" in text
    # offline: baton 1 s and 2 s against vLLM's 2 s: ratios 2.00 and 1.00, median 1.50
    assert "**1.50x** (2.00 / 1.00)" in text
    assert "| engine >= 1.3x vLLM offline (fp32) | 1.50x | met |" in text
    assert "| `baton up` >= 1.0x `vllm serve`, concurrency 1 (fp32) | 1.25x | met |" in text
    assert f"{2 * REQUESTS}/{2 * REQUESTS} |" in text  # identical greedy requests over 2 rounds


def test_saving_the_same_results_twice_gives_the_same_bytes(results, tmp_path):
    first = raw.save(results, tmp_path / "a.json.gz").read_bytes()
    assert raw.save(results, tmp_path / "b.json.gz").read_bytes() == first


def test_a_request_that_differs_in_fp32_fails_the_run():
    expected = [raw.digest([1, 2]), raw.digest([3, 4])]
    check_identical("same", expected, list(expected))  # no error
    with pytest.raises(RuntimeError, match="1 of 2 requests differ .* request 1"):
        check_identical("offline round 1", expected, [expected[0], raw.digest([3, 5])])
