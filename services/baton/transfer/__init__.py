"""KV transfer, one home: a cache's trip from a chain's tail into a decode pod's pool.

* ``codec``        the payload's header, layout, checksum and checks (no gRPC)
* ``handoff``      the push's header as the decode pod sees it, and the first token
* ``framing``      the PushKV messages: header, chunks framed by hand, first token, trailer
* ``sender``       the tail's side: a request's shipment over its open PushKV call
* ``receiver``     the decode pod's side: a PushKV stream read, checked and landing
* ``assembler``    bytes into a checked cache as they arrive (kept pieces or landed blocks)
* ``received``     a received layer's pieces, and how they go into the pool's blocks
* ``device_copy``  KV between a GPU and pinned host memory on a copy stream
* ``nixl``, ``ucx_devices``  the RDMA data plane and the interfaces UCX may use

The pool is reached through one narrow interface, ``baton.kv.landing`` (store a cache, land
one while it arrives); the tail and the decode pod keep only their own side's logic.
"""
