"""A checkpoint's ``generation_config.json``: the sampling its authors ship as the default
and the extra end-of-sequence ids (Llama 3's instruct models end turns with ``<|eot_id|>``,
which config.json does not list). As vLLM's ``--generation-config auto``: a request that
leaves temperature, top_p, top_k, min_p or repetition_penalty out gets the checkpoint's; what baton cannot apply is
named in the log at start, never silently taken as applied.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from baton.model.errors import CheckpointError

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# vLLM's defaults from the file: what a request that leaves the field out gets.
APPLIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Sampling settings baton cannot apply, with the value that changes nothing.
UNAPPLIED = {"num_beams": 1, "no_repeat_ngram_size": 0}


@dataclass(frozen=True)
class GenerationConfig:
    sampling: dict[str, float | int] = field(default_factory=dict)  # APPLIED keys it sets
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, directory: Path) -> GenerationConfig:
        path = directory / FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(str(path), FILE, f"is not valid JSON: {e}") from e
        eos = data.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        sampling = {key: data[key] for key in APPLIED if data.get(key) is not None}
        for key, neutral in UNAPPLIED.items():
            if data.get(key) not in (None, neutral):
                log.warning("%s: %s %r is not applied (baton has no %s yet)", path, key, data[key], key)
        return cls(sampling, eos_ids)
