"""Regenerate ``baton.api.v1`` from ``proto/baton/v1/*.proto`` (``make proto``).

protoc writes ``baton/v1/<name>_pb2.py`` (+ ``.pyi`` stubs and ``_pb2_grpc.py``) importing
``from baton.v1 import ...``; this module flattens them into ``services/baton/api/v1/`` and
rewrites those imports to ``baton.api.v1`` so the generated code lives in one corner of the
``baton`` package. The proto files keep their ``baton/v1/...`` names inside the descriptors,
so other languages generated from the same files agree on message names.

``python -m baton.api.generate --out DIR`` writes elsewhere (the staleness test compares).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE = "baton/v1"
OUTPUT_DIR = Path(__file__).resolve().parent / "v1"
PACKAGE_INIT = '"""Generated from proto/baton/v1 by `python -m baton.api.generate`; do not edit."""\n'

# `from baton.v1 import x_pb2` and `import baton.v1.x_pb2` (the forms protoc and mypy emit).
_IMPORT_FROM = re.compile(r"^from baton\.v1 import ", re.MULTILINE)
_IMPORT_MODULE = re.compile(r"\bbaton\.v1\.(\w+_pb2)\b")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((proto_root / PROTO_PACKAGE).glob("*.proto"))


def _run_protoc(work_dir: Path, proto_root: Path) -> None:
    """protoc (grpcio-tools, a dev dependency) in a process of its own: its compiler's native
    libraries clash with others a process may have loaded already (NIXL's abseil)."""
    tools = importlib.util.find_spec("grpc_tools")
    if tools is None or not tools.submodule_search_locations:
        raise FileNotFoundError("grpcio-tools is missing: install the dev extras "
                                "(pip install -e '.[dev]')")
    include = Path(tools.submodule_search_locations[0]) / "_proto"  # google/protobuf/*.proto
    # mypy-protobuf's plugin writes the .pyi stubs of the _pb2_grpc modules (protoc has none)
    grpc_stub_plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    if not grpc_stub_plugin.is_file():
        raise FileNotFoundError(f"{grpc_stub_plugin} is missing: install the dev extras "
                                f"(pip install -e '.[dev]')")
    args = [f"-I{proto_root}", f"-I{include}",
            f"--plugin=protoc-gen-mypy_grpc={grpc_stub_plugin}",
            f"--python_out={work_dir}", f"--pyi_out={work_dir}", f"--grpc_python_out={work_dir}",
            f"--mypy_grpc_out={work_dir}",
            *[str(path.relative_to(proto_root)) for path in proto_files(proto_root)]]
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed with status {done.returncode}: {' '.join(args)}\n"
                           f"{done.stderr}")


def _has_content(path: Path, proto_root: Path) -> bool:
    """False for the empty _pb2_grpc modules and stubs of protos that declare no service."""
    stem, grpc_suffix, _ = path.name.partition("_pb2_grpc.")
    if not grpc_suffix:
        return True
    proto = proto_root / PROTO_PACKAGE / f"{stem}.proto"
    return re.search(r"^service ", proto.read_text(), re.MULTILINE) is not None


def _fix_imports(text: str) -> str:
    text = _IMPORT_FROM.sub("from baton.api.v1 import ", text)
    return _IMPORT_MODULE.sub(r"baton.api.v1.\1", text)


def generate(output_dir: Path = OUTPUT_DIR, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write the generated package into ``output_dir`` (replacing it); returns the files."""
    if not proto_files(proto_root):
        raise FileNotFoundError(f"no .proto files under {proto_root / PROTO_PACKAGE}")
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        _run_protoc(work_dir, proto_root)
        generated = [path for path in sorted((work_dir / PROTO_PACKAGE).iterdir())
                     if _has_content(path, proto_root)]
        if output_dir.exists():
            shutil.rmtree(output_dir)
        output_dir.mkdir(parents=True)
        (output_dir / "__init__.py").write_text(PACKAGE_INIT)
        written = [output_dir / "__init__.py"]
        for source in generated:
            target = output_dir / source.name
            target.write_text(_fix_imports(source.read_text()))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT_DIR, help="directory to write into")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
