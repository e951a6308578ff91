"""bench/common.py: what a run records (commit, command, machine with its vector
instructions) and the header every report opens with; and every report under
docs/benchmarks/ names its command, commit and machine and keeps its raw results."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]
import common

REPORTS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))


@pytest.mark.parametrize("flags, named", [
    (["avx2"], "AVX2 only"),
    (["avx2", "avx512f"], "AVX-512 without BF16"),
    (["avx2", "avx512f", "avx512_bf16"], "AVX-512 with BF16"),
    (["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], "AVX-512 with BF16, AMX"),
    ([], "no AVX2"),
])
def test_the_instruction_sets_are_named_from_the_cpuinfo_flags(flags, named):
    assert common.instruction_sets(flags) == named


def test_a_recorded_machine_names_its_cpu_model_and_instruction_sets():
    recorded = common.machine()
    assert set(recorded["vector_flags"]) <= set(common.VECTOR_FLAGS)
    line = common.describe_machine(recorded)
    assert recorded["cpu"] in line and common.instruction_sets(recorded["vector_flags"]) in line


@pytest.mark.parametrize("older, named", [
    ("2 CPU cores (AMD EPYC, AVX2), no GPU", "2 CPU cores (AMD EPYC, AVX2 only), no GPU"),
    ("2 CPU cores (AMD EPYC, AVX512 with BF16), no GPU",
     "2 CPU cores (AMD EPYC, AVX-512 with BF16), no GPU"),
    ("2 CPU cores (Intel Xeon, AVX512), no GPU", "2 CPU cores (Intel Xeon, AVX-512 without BF16), no GPU"),
])
def test_an_older_machine_line_names_its_instruction_sets_as_a_new_one_does(older, named):
    assert common.describe_machine(older) == named


def test_the_run_record_holds_the_commit_and_the_command_line():
    record = common.run_record(["bench/example.py", "--rounds", "2"])
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", record["commit"])
    assert record["command"] == "python bench/example.py --rounds 2"
    header = common.report_header("Example", "bench/example.py", "example", {"run": record})
    assert header.startswith("# Example\n")
    assert "`python bench/example.py --rounds 2`" in header and f"`{record['commit']}`" in header
    assert "[example-results.json.gz](example-results.json.gz)" in header
    assert common.instruction_sets(record["machine"]["vector_flags"]) in header


@pytest.mark.parametrize("older, commit", [
    ({"commit": "0123456789abcdef", "clean": False, "started": "then", "machine": "m"},
     "0123456789ab+dirty"),
    ({"provenance": {"commit": "0123456789abcdef", "dirty": False, "started": "then"},
      "machine": "m"}, "0123456789ab"),
])
def test_results_recorded_before_the_run_record_still_name_their_commit(older, commit):
    run = common.recorded_run(older)
    assert run["commit"] == commit and run["machine"] == "m" and run["command"] is None
    header = common.report_header("Example", "bench/example.py", "example", older,
                                  "python bench/example.py --rounds 3")
    assert "`python bench/example.py --rounds 3`" in header


@pytest.mark.parametrize("report", REPORTS, ids=lambda path: path.name)
def test_every_report_names_its_command_commit_and_machine_and_keeps_its_raw_results(report):
    text = report.read_text()
    assert re.search(r"Measured by `[^`]+` .*at commit `[0-9a-f]{7,}", text), "command and commit"
    # the CPU's model may hold parentheses of its own ("Intel(R) Xeon(R) Processor")
    assert re.search(r"Machine: .*\((?:[^()]|\(\w+\))*, (AVX2 only|AVX-512 with(out)? BF16|no AVX2)", text), \
        "the CPU model and its instruction sets"
    raw = re.search(r"\[([\w.-]+-results\.json\.gz)\]", text)
    assert raw and (report.parent / raw[1]).is_file(), "the raw results beside it"


def _rendered(report: str) -> str:
    """``report`` as its script renders it now from the committed raw results."""
    sys.path[:0] = [str(ROOT / "bench" / "peer")]
    import autoscale
    import fp8_kv
    import gpu_decode
    import gpu_profile
    import kv_pipelining
    import kv_transfer
    import moe_step
    import pd_model
    import prefix
    import report as peer_report
    import results as peer_results
    import route_ttft
    import sampling_cost
    import sarathi
    import shared_prefix
    import tp_cost
    import trace_overhead

    renders = {
        "autoscale.md": lambda: autoscale.render(common.load_results("autoscale")),
        "kv-pipelining.md": lambda: kv_pipelining.report(common.load_results("kv-pipelining")),
        "kv_transfer.md": lambda: kv_transfer.report(common.load_results("kv-transfer")),
        "pd-model.md": lambda: pd_model.report(*map(common.load_results,
                                                   ("pd-model", "route-ttft", "kv-transfer"))),
        "prefix.md": lambda: prefix.render(common.load_results("prefix")),
        "peer.md": lambda: peer_report.render(peer_results.load()),
        "peer-prefix.md": lambda: shared_prefix.render(peer_results.load(shared_prefix.RESULTS_PATH)),
        "route-ttft.md": lambda: route_ttft.report(common.load_results("route-ttft")),
        "fp8-kv.md": lambda: fp8_kv.report(common.load_results("fp8-kv")),
        "sampling-cost.md": lambda: sampling_cost.report(common.load_results("sampling-cost")),
        "moe-step.md": lambda: moe_step.report(common.load_results("moe-step")),
        "trace-overhead.md": lambda: trace_overhead.report(common.load_results("trace-overhead")),
        "tp-cost.md": lambda: tp_cost.report(common.load_results("tp-cost")),
        "decode-gpu.md": lambda: gpu_decode.report(common.load_results("decode-gpu")),
        "decode-gpu-profile.md": lambda: gpu_profile.report(common.load_results("decode-gpu-profile")),
        "sarathi-gpu-1b.md": lambda: _without_plots(sarathi, "sarathi-gpu-1b"),
    }
    return renders[report]()


def _without_plots(sarathi, name: str) -> str:
    """A SARATHI report's text (its plots, committed beside it, are not drawn again)."""
    from unittest import mock

    with mock.patch.object(sarathi, "plot", lambda runs, x_of, x_label, png, title: png):
        return sarathi.render(common.load_results(name), name)


@pytest.mark.parametrize("report", REPORTS, ids=lambda path: path.name)
def test_every_report_is_what_its_script_renders_from_the_committed_raw_results(report):
    assert _rendered(report.name) == report.read_text(), \
        f"{report.name} is stale: render it again with its script's --render"
