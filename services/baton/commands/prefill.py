"""`baton prefill`: flags come from `baton.config.PrefillServiceConfig`."""

from __future__ import annotations

import argparse

from baton.config import PrefillServiceConfig
from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, PrefillServiceConfig)


def load_config(args: argparse.Namespace) -> PrefillServiceConfig:
    """The validated configuration (raises ValueError naming the bad value)."""
    return from_arguments(args, PrefillServiceConfig)


def run(args: argparse.Namespace) -> int:
    from baton.prefill.server import serve

    return serve(load_config(args))
