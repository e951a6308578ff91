"""A KV-Runahead prefill chain, and the data plane its KV reaches decode pods over."""

from __future__ import annotations

from baton.configtree import require, setting, settings
from baton.registry import Registry

# The PushKV stream itself, and NIXL (baton.transfer.nixl): what each opens, baton.transfer.planes.
KV_TRANSPORTS = Registry("kv transport", ("grpc", "nixl"), home="baton.transfer.planes")
RUNAHEAD_MODES = ("runahead", "tsp")
KV_SHIPPING = ("by-layer", "after-prefill")
CHAIN_BACKENDS = ("auto", "gloo", "nccl")


@settings("kv_transport")
class KVTransportConfig:
    kind: str = setting("grpc", "the data plane of pushed KV caches: grpc = the PushKV stream "
                        "itself; nixl = NIXL (UCX: RDMA where the cluster has it) for the bytes, "
                        "gRPC for the rest, with any peer that reads over NIXL too (gRPC with the "
                        "others); needs the nixl package (`make nixl`)", choices=KV_TRANSPORTS)
    nixl_read_timeout_s: float = setting(60.0, "a decode pod's NIXL read of a pushed layer or "
                                         "cache taking longer fails the push (DATA_LOSS)",
                                         exclusive_minimum=0)


@settings("chain")
class ChainConfig:
    ranks: int = setting(2, "processes (GPUs) in a prefill chain", minimum=1)
    rank: int = setting(0, "this process's rank in its chain (the pod ordinal)")
    chain_id: str = setting("chain-0", "name of the chain this process belongs to")
    master_addr: str = setting("127.0.0.1", "rendezvous host: rank 0's address")
    master_port: int = setting(29500, "rendezvous port on rank 0", minimum=1, maximum=65535)
    backend: str = setting("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU",
                           choices=CHAIN_BACKENDS)
    mode: str = setting("runahead", "runahead = KV-Runahead; tsp = tensor/sequence-parallel baseline",
                        choices=RUNAHEAD_MODES)
    partition_table: str = setting("", "JSON partition table; empty = the shipped default table")
    timeout_s: float = setting(60.0, "a rank waiting longer than this on a peer gives up",
                               exclusive_minimum=0)
    # What the chain's route costs beyond its compute, for the break-even it advertises
    # (baton.runahead.break_even). The defaults are what this route measured on one host.
    kv_link_gb_per_s: float = setting(1.1, "the rate its KV reaches a decode pod, in GB/s: "
                                      "PushKV's end-to-end rate (1.1 measured on a 2-core "
                                      "host), or the link's with NIXL over RDMA (~11 for "
                                      "100 Gbit/s)", exclusive_minimum=0)
    extra_hop_ms: float = setting(6.0, "what the chain's route costs a request beyond the "
                                  "decode pod's own prefill besides compute and the KV "
                                  "(one more call; 6 ms measured on one host, ~1 in a cluster)",
                                  minimum=0)
    kv_shipping: str = setting("by-layer", "how the tail ships a prompt's KV: by-layer = each "
                               "layer as soon as it is computed, the first token before the "
                               "last layer; after-prefill = the whole cache once the logits "
                               "exist, the first token on its header", choices=KV_SHIPPING)

    def __post_init__(self) -> None:
        require(0 <= self.rank < self.ranks, f"chain rank {self.rank} is outside 0..{self.ranks - 1}")
