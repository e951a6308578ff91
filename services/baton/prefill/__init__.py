"""`baton prefill`: a KV-Runahead prefill chain behind gRPC (the Prefill service of ``baton.v1``).

``server`` runs one rank, ``frontend`` is rank 0's servicer and request source, ``tail`` ships
each cache to a decode pod, ``exchange`` carries per-request details and events between rank 0
and the tail through the chain's rendezvous store.
"""
