"""KV-Runahead prefill chains, the TSP baseline, partition tables and their tuner."""

from baton.runahead.errors import ChainError
from baton.runahead.local import LocalChain, prefill_with_local_chain
from baton.runahead.partition import even_boundaries, validate_boundaries
from baton.runahead.request import ChainRequest, ChainResult, ModelSource, make_request
from baton.runahead.table import PartitionTable, TableEntry, choose_chain_size
from baton.runahead.transport import RankCounters

__all__ = ["ChainError", "ChainRequest", "ChainResult", "LocalChain", "ModelSource",
           "PartitionTable", "RankCounters", "TableEntry", "choose_chain_size", "even_boundaries",
           "make_request", "prefill_with_local_chain", "validate_boundaries"]
