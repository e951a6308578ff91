"""The committed generated code is what `make proto` produces from proto/ today."""

from __future__ import annotations

import filecmp
import importlib
import shutil
from pathlib import Path

import pytest
from baton.api import generate

pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extras) regenerates the code")


def stale_files(fresh: Path, committed: Path) -> list[str]:
    """Names that differ between two generated packages (missing on either side included)."""
    fresh_names = {path.name for path in fresh.iterdir()}
    committed_names = {path.name for path in committed.iterdir()
                       if path.is_file() and path.suffix in (".py", ".pyi")}
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, sorted(fresh_names & committed_names),
                                           shallow=False)
    return sorted(set(mismatch + errors) | (fresh_names ^ committed_names))


def test_committed_code_is_current(tmp_path):
    generate.generate(tmp_path / "v1")
    assert stale_files(tmp_path / "v1", generate.OUTPUT_DIR) == [], "run `make proto`"


def test_a_proto_change_makes_the_committed_code_stale(tmp_path):
    protos = tmp_path / "proto"
    shutil.copytree(generate.PROTO_ROOT, protos)
    kv_proto = protos / generate.PROTO_PACKAGE / "kv.proto"
    kv_proto.write_text(kv_proto.read_text().replace("uint64 total_bytes = 10;",
                                                     "uint64 total_bytes = 10;\n  bool extra = 99;"))
    generate.generate(tmp_path / "v1", proto_root=protos)
    assert stale_files(tmp_path / "v1", generate.OUTPUT_DIR) == ["kv_pb2.py", "kv_pb2.pyi"]


def test_imports_point_into_the_package(tmp_path):
    generate.generate(tmp_path / "v1")
    for path in (tmp_path / "v1").iterdir():
        imports = [line for line in path.read_text().splitlines() if "import " in line]
        assert not [line for line in imports if "baton.v1" in line], path.name
    assert not (tmp_path / "v1" / "kv_pb2_grpc.py").exists(), "no module for a service-less proto"


@pytest.mark.parametrize("module, stub", [("api_pb2_grpc", "BatonStub"),
                                          ("prefill_pb2_grpc", "PrefillStub"),
                                          ("decode_pb2_grpc", "DecodeStub")])
def test_generated_services_import(module, stub):
    assert hasattr(importlib.import_module(f"baton.api.v1.{module}"), stub)


def test_health_service_is_the_standard_one():
    from grpc_health.v1 import health_pb2

    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
