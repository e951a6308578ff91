"""What `baton prefill`, `baton decode` and `baton gateway` share: flags from a config class."""

from __future__ import annotations

import argparse
import importlib

from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import from_arguments


class ServiceCommand:
    """A service subcommand: flags derive from ``config_class``; ``run`` calls
    ``<server_module>.serve(config)``."""

    def __init__(self, config_class: type, server_module: str) -> None:
        self.config_class = config_class
        self.server_module = server_module

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_config_arguments(parser, self.config_class)

    def load_config(self, args: argparse.Namespace):
        """The validated configuration (raises ValueError naming the bad value)."""
        return from_arguments(args, self.config_class)

    def run(self, args: argparse.Namespace) -> int:
        return importlib.import_module(self.server_module).serve(self.load_config(args))
