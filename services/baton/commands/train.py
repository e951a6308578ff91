"""`baton train`: flags come from `baton.config.TrainConfig`."""

from __future__ import annotations

import argparse

from baton.config import TrainConfig
from baton.configtree import add_arguments as add_config_arguments
from baton.configtree import from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainConfig)


def run(args: argparse.Namespace) -> int:
    from baton.train.trainer import train

    def log(line: str) -> None:
        print(line, flush=True)

    train(from_arguments(args, TrainConfig), log)
    return 0
