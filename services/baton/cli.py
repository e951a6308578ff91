"""`baton ...`: the one entry point for every tool and service.

Each subcommand lives in its own module under ``baton.commands`` exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only
when their command runs, so `baton generate` never pays for gRPC or kopf.
Services (`prefill`, `decode`, `gateway`) take their flags from the typed
configuration tree (``baton.config``) through ``baton.configtree``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("baton.commands.generate", "generate text locally or from a server"),
    "train": ("baton.commands.train", "train the shipped small model on the Python stdlib"),
    "tune-partitions": ("baton.commands.tune_partitions",
                        "find KV-Runahead partitions by hierarchical grid search"),
    "prefill": ("baton.commands.prefill", "run one rank of a KV-Runahead prefill chain (gRPC)"),
    "decode": ("baton.commands.decode", "run a SARATHI decode worker (gRPC)"),
    "gateway": ("baton.commands.gateway", "run the client-facing gateway (gRPC, and the OpenAI HTTP API)"),
    "up": ("baton.commands.up", "run the whole service on this machine"),
    "fetch-model": ("baton.commands.fetch_model",
                    "download a Hugging Face model into the local cache, unless it is there"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        _command_module(module_name).add_arguments(sub)
    return parser


def _command_module(module_name: str):
    return importlib.import_module(module_name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(_command_module(args._module).run(args) or 0)
    except ValueError as e:  # bad configuration or input: one clear line, no traceback
        print(f"baton {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
