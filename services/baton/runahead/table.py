"""Partition tables: the measured best slices per (ranks p, context C), and the chain-size rule.

A table is a JSON file (the operator mounts it from a ConfigMap)::

    {"name": "cpu-dev", "measured_on": {...free-form notes...},
     "min_context": {"2": 1024},            # smallest C where p ranks beat one process
     "entries": [{"ranks": 2, "context_length": 4096, "fractions": [0.58, 1.0],
                  "ttft_s": 1.9, "ttft_even_s": 2.1, "ttft_single_s": 3.0}, ...]}

``fractions`` are the cumulative slice ends ``b_i / C`` for i = 1..p, so an
entry applies to any C: an unseen C takes the linear interpolation of the two
nearest entries' fractions (the nearest one outside the measured range).
``min_context`` is KV-Runahead's appendix B made concrete: below it the link
and the per-rank overheads cost more than parallel prefill saves, so a prompt
that short runs on fewer ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baton.runahead.break_even import COMPUTE_ONLY, Link, break_even
from baton.runahead.partition import boundaries_from_fractions

TABLES_DIR = Path(__file__).resolve().parent / "tables"
DEFAULT_TABLE = TABLES_DIR / "cpu-dev.json"


@dataclass
class TableEntry:
    ranks: int
    context_length: int
    fractions: list[float]  # cumulative slice ends b_1/C .. b_p/C (the last is 1.0)
    ttft_s: float = 0.0  # measured with these fractions
    ttft_even_s: float = 0.0  # measured with even slices
    ttft_single_s: float = 0.0  # one process using all the chain's threads

    def __post_init__(self) -> None:
        where = f"partition entry (ranks {self.ranks}, context {self.context_length})"
        if self.ranks < 1 or self.context_length < 1:
            raise ValueError(f"{where}: ranks and context_length must be >= 1")
        if len(self.fractions) != self.ranks:
            raise ValueError(f"{where}: {len(self.fractions)} fractions for {self.ranks} ranks")
        if any(b < a for a, b in zip([0.0] + self.fractions, self.fractions)) or \
                abs(self.fractions[-1] - 1.0) > 1e-9:
            raise ValueError(f"{where}: fractions {self.fractions} must rise to 1.0")


@dataclass
class PartitionTable:
    name: str
    entries: list[TableEntry] = field(default_factory=list)
    min_context: dict[int, int] = field(default_factory=dict)  # ranks -> smallest C worth it
    measured_on: dict[str, Any] = field(default_factory=dict)

    # --- files --------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> PartitionTable:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ValueError(f"partition table {path} does not exist") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"partition table {path} is not valid JSON: {e}") from e
        try:
            return cls(name=data.get("name", path.stem),
                       entries=[TableEntry(**entry) for entry in data["entries"]],
                       min_context={int(p): int(c) for p, c in data.get("min_context", {}).items()},
                       measured_on=data.get("measured_on", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"partition table {path}: {e}") from e

    @classmethod
    def load(cls, path: str | Path = "") -> PartitionTable:
        """A table file; empty path = the shipped default for the CPU development setup."""
        return cls.from_file(path or DEFAULT_TABLE)

    def to_dict(self) -> dict[str, Any]:
        entries = sorted(self.entries, key=lambda e: (e.ranks, e.context_length))
        return {"name": self.name, "measured_on": self.measured_on,
                "min_context": {str(p): c for p, c in sorted(self.min_context.items())},
                "entries": [asdict(entry) for entry in entries]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # --- lookups ------------------------------------------------------------------------

    def ranks(self) -> list[int]:
        return sorted({entry.ranks for entry in self.entries})

    def require_ranks(self, ranks: int) -> None:
        if ranks > 1 and ranks not in self.ranks():
            raise ValueError(f"partition table {self.name!r} has entries for ranks {self.ranks()}, "
                             f"not for a chain of {ranks}")

    def put(self, entry: TableEntry) -> None:
        """Add an entry, replacing any for the same (ranks, context_length)."""
        self.entries = [e for e in self.entries
                        if (e.ranks, e.context_length) != (entry.ranks, entry.context_length)]
        self.entries.append(entry)

    def fractions(self, ranks: int, context_length: int) -> list[float]:
        """The best cumulative fractions for (p, C), interpolated between the two nearest entries."""
        if ranks == 1:
            return [1.0]
        self.require_ranks(ranks)
        entries = sorted((e for e in self.entries if e.ranks == ranks),
                         key=lambda e: e.context_length)
        below = [e for e in entries if e.context_length <= context_length]
        above = [e for e in entries if e.context_length >= context_length]
        if not below:
            return list(above[0].fractions)
        if not above:
            return list(below[-1].fractions)
        low, high = below[-1], above[0]
        if low.context_length == high.context_length:
            return list(low.fractions)
        weight = (context_length - low.context_length) / (high.context_length - low.context_length)
        return [a + weight * (b - a) for a, b in zip(low.fractions, high.fractions)]

    def boundaries(self, ranks: int, context_length: int) -> list[int]:
        return boundaries_from_fractions(self.fractions(ranks, context_length), context_length)

    @property
    def device_type(self) -> str:
        """The kind of device the table was measured on (``baton tune-partitions`` runs on the
        CPU; a table that does not say was measured there too)."""
        return str(self.measured_on.get("device", "cpu"))

    def points(self, ranks: int) -> list[tuple[int, float, float]]:
        """(C, one process's TTFT, the chain's TTFT) of each measured length for ``ranks``."""
        return sorted((entry.context_length, entry.ttft_single_s, entry.ttft_s)
                      for entry in self.entries if entry.ranks == ranks and entry.ttft_single_s)

    def break_even(self, ranks: int, device_type: str, kv_per_token: float = 0.0,
                   link: Link = COMPUTE_ONLY) -> int:
        """The shortest prompt from which a chain of ``ranks`` on ``device_type`` gives the
        first token sooner than one process, its KV's transfer over ``link`` counted
        (``baton.runahead.break_even``); 0 when it was not measured (another kind of device,
        or no entry for that many ranks): a CPU's break-even says nothing of a GPU's."""
        if device_type != self.device_type:
            return 0
        points = self.points(ranks)
        if not points:
            return self.min_context.get(ranks, 0)
        return break_even(points, kv_per_token, link)

    def chain_size(self, context_length: int, max_ranks: int) -> int:
        """The most ranks (up to ``max_ranks``) that pay off for a prompt of this length."""
        worth = [p for p, c in self.min_context.items() if p <= max_ranks and context_length >= c]
        return max(worth, default=1)


def choose_chain_size(context_length: int, max_ranks: int, table: PartitionTable | None = None) -> int:
    """KV-Runahead's chain-size rule from the measured table (the shipped one by default)."""
    return (table or PartitionTable.load()).chain_size(context_length, max_ranks)
