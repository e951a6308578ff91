"""`baton prefill`: a KV-Runahead prefill chain behind gRPC (the Prefill service of ``baton.v1``).

``server`` runs one rank, ``frontend`` is rank 0's servicer and request source (it
broadcasts each request's details with its tokens), ``tail`` samples the first token and
ships it with the cache to a decode pod.
"""
