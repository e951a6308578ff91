"""`baton up --autoscale`: the planner's flags become the cluster's settings, the decode pods
start within its bounds and their threads are sized for the most pods it may run."""

from __future__ import annotations

import argparse
import os

import pytest
from baton.commands import up
from baton.config import PlannerConfig
from baton.local.spec import ClusterSpec

CORES = len(os.sched_getaffinity(0))


def parse(*argv: str) -> ClusterSpec:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.cluster_spec(parser.parse_args(list(argv)))


def test_without_autoscale_there_is_no_planner():
    assert parse("--min-decode-pods", "2").autoscale is None


def test_the_planner_flags_set_the_cluster_and_it_starts_within_their_bounds():
    spec = parse("--autoscale", "--min-decode-pods", "2", "--max-decode-pods", "3",
                 "--itl-p90-s", "0.05", "--interval-s", "2")
    assert spec.autoscale == PlannerConfig(min_decode_pods=2, max_decode_pods=3, itl_p90_s=0.05,
                                           interval_s=2.0)
    assert spec.decode_workers == 2  # --decode-workers 1 raised to the minimum
    assert spec.threads_of("decode") == max(1, CORES // 3)  # room for the most pods
    assert parse("--decode-grace-s", "2").decode_grace_s == 2.0


@pytest.mark.parametrize("argv, words", [
    (("--max-decode-pods", "9"), "<= 8 on one machine"),
    (("--min-decode-pods", "3", "--max-decode-pods", "2"), "1 <= min (3) <= max (2)"),
])
def test_bounds_one_machine_cannot_run_are_refused(argv, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse("--autoscale", *argv)


def test_a_planner_trace_needs_the_planner(tmp_path):
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--planner-trace", str(tmp_path / "trace.jsonl")])
    with pytest.raises(ValueError, match="--planner-trace needs --autoscale"):
        up.run(args)  # refused before anything starts
    assert not (tmp_path / "trace.jsonl").exists()


def test_the_help_shows_the_planners_flags_with_their_percent_signs():
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--max-decode-pods INT" in text and "90% of requests" in text
