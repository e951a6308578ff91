"""`baton up`'s threads per process (the decode pods get the machine's cores unless told), and
what every model process is given alike."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
from baton.commands import up
from baton.local.spec import ClusterSpec


def parse(*argv: str) -> ClusterSpec:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.cluster_spec(parser.parse_args(list(argv)))


CORES = len(os.sched_getaffinity(0))


def test_by_default_the_decode_pods_share_the_cores_and_chain_ranks_get_one_thread():
    spec = parse()
    assert spec.threads_of("prefill") == 1
    assert spec.threads_of("decode") == CORES
    assert parse("--decode-workers", "2").threads_of("decode") == max(1, CORES // 2)


def test_threads_given_alone_sets_every_process():
    spec = parse("--threads", "3")
    assert (spec.threads_of("prefill"), spec.threads_of("decode")) == (3, 3)


def test_decode_threads_overrides_threads_for_the_decode_pods_only():
    spec = parse("--threads", "2", "--decode-threads", "5")
    assert (spec.threads_of("prefill"), spec.threads_of("decode")) == (2, 5)
    assert parse("--decode-threads", "0").threads_of("decode") == CORES  # 0: automatic


@pytest.mark.parametrize("argv, named", [(("--threads", "0"), "threads_per_process"),
                                         (("--decode-threads", "-1"), "decode_threads")])
def test_a_bad_thread_count_is_refused_naming_it(argv, named):
    with pytest.raises(ValueError, match=named):
        parse(*argv)


def test_each_process_is_started_with_its_roles_thread_count(tmp_path):
    from baton.local.cluster import LocalCluster

    cluster = LocalCluster(ClusterSpec(threads_per_process=1, decode_threads=3, mtls=False),
                           log_dir=tmp_path)
    for role, threads in (("decode", "3"), ("prefill", "1")):
        args = cluster._common_args(role)
        assert args[args.index("--model-threads") + 1] == threads
    assert "--model-threads" not in cluster._common_args("gateway")


def test_an_fp8_kv_cache_is_given_to_the_chain_and_the_decode_pods_alike(tmp_path):
    from baton.local.cluster import LocalCluster

    spec = parse("--kv-cache-dtype", "fp8_e5m2", "--kv-cache-scale", "0.25")
    cluster = LocalCluster(dataclasses.replace(spec, mtls=False), log_dir=tmp_path)
    for role in ("decode", "prefill"):
        args = cluster._common_args(role)
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
        assert float(args[args.index("--kv-cache-scale") + 1]) == 0.25
    assert "--kv-cache-dtype" not in cluster._common_args("gateway")
    with pytest.raises(SystemExit):  # argparse names the choices
        parse("--kv-cache-dtype", "int4")
