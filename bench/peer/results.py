"""The peer benchmark's raw results in a compact form: what the report is rendered from.

One gzipped JSON file (``docs/benchmarks/peer-results.json.gz``) holds a whole run: the
commit and the times it ran, the machine, the configuration of both systems, and every
run's per-request figures (times in milliseconds, rounded to 0.01 ms). Token ids and texts
are kept as digests, enough to check agreement; the prompts are not kept (the workload is
remade from its seed by ``workload.py``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_PATH = ROOT / "docs" / "benchmarks" / "peer-results.json.gz"


def digest(value: list[int] | str) -> str:
    """A short fingerprint of a request's output: its token ids or its text."""
    data = value.encode() if isinstance(value, str) else ",".join(map(str, value)).encode()
    return hashlib.sha1(data).hexdigest()[:16]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000.0, 2)


def offline_run(result: dict) -> dict:
    """One offline run (``offline_baton.py``/``offline_vllm.py``'s JSON) in compact form."""
    return {"system": result["system"], "dtype": result["dtype"],
            "token_budget": result.get("token_budget"), "max_seqs": result.get("max_seqs"),
            "load_s": round(result["load_s"], 2),
            "wall_s": round(result["wall_s"], 4), "own_cpu_s": round(result["own_cpu_s"], 2),
            "others_cpu_s": round(result["others_cpu_s"], 2),
            "generated_tokens": result["generated_tokens"],
            "ttft_ms": [_ms(t) for t in result["ttft_s"]],
            "token_digests": [digest(ids) for ids in result["token_ids"]]}


def served_run(result: dict) -> dict:
    """One ``vllm bench serve`` scenario (``served.vllm_bench``'s result) in compact form."""
    return {"wall_s": round(result["wall_s"], 4), "generated_tokens": result["generated_tokens"],
            "completed": result["completed"], "output_lens": result["output_lens"],
            "ttft_ms": [_ms(t) for t in result["ttft_s"]],
            "itl_ms": [[_ms(gap) for gap in gaps] for gaps in result["itl_s"]],
            "latency_ms": [_ms(t) for t in result["latency_s"]],
            "text_digests": [digest(text) for text in result["texts"]],
            "errors": result["errors"], "others_cpu_s": round(result["others_cpu_s"], 2),
            "cpu_by_role_s": {role: round(s, 2) for role, s in result["cpu_by_role_s"].items()}}


def save(results: dict, path: Path = RESULTS_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file, gzip.GzipFile(filename="", fileobj=file, mode="wb", mtime=0) as packed:
        packed.write(json.dumps(results, separators=(",", ":")).encode())  # same results, same bytes
    return path


def load(path: Path = RESULTS_PATH) -> dict:
    with gzip.open(path, "rt") as handle:
        return json.load(handle)
