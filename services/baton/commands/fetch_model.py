"""`baton fetch-model`: put a Hugging Face model into the local cache before a server starts.

The operator runs it as an init container of every pod that serves an ``hf://`` model,
with ``HF_HOME`` on the pod's model volume: a snapshot already there is not fetched again,
so a restarted pod, or every pod sharing one volume, downloads the model once.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="the model's Hugging Face repo id (org/name)")
    parser.add_argument("--revision", default="",
                        help="a branch, tag or commit (default: main)")
    parser.add_argument("--without-weights", action="store_true",
                        help="leave the safetensors out: config and tokenizer only (a gateway's)")


def run(args: argparse.Namespace) -> int:
    from baton.model.hub import fetch_model, is_repo_id

    if not is_repo_id(args.repo_id):
        raise ValueError(f"{args.repo_id!r} is not a Hugging Face repo id (org/name)")
    files, downloaded = fetch_model(args.repo_id, args.revision,
                                    weights=not args.without_weights)
    done = "downloaded into" if downloaded else "already in"
    print(f"{files.name}@{files.revision}: {done} {files.directory}", flush=True)
    return 0
