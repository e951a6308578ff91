"""`baton decode`: flags come from `baton.config.DecodeServiceConfig`."""

from __future__ import annotations

import argparse

from baton.config import DecodeServiceConfig
from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, DecodeServiceConfig)


def load_config(args: argparse.Namespace) -> DecodeServiceConfig:
    """The validated configuration (raises ValueError naming the bad value)."""
    return from_arguments(args, DecodeServiceConfig)


def run(args: argparse.Namespace) -> int:
    from baton.decode.server import serve

    return serve(load_config(args))
