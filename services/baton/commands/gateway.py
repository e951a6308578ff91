"""`baton gateway`: flags come from `baton.config.GatewayServiceConfig`."""

from __future__ import annotations

import argparse

from baton.config import GatewayServiceConfig
from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayServiceConfig)


def load_config(args: argparse.Namespace) -> GatewayServiceConfig:
    """The validated configuration (raises ValueError naming the bad value)."""
    return from_arguments(args, GatewayServiceConfig)


def run(args: argparse.Namespace) -> int:
    from baton.gateway.server import serve

    return serve(load_config(args))
