"""`baton decode`: the SARATHI decode pod behind gRPC (the Decode service of ``baton.v1``).

``server`` builds and runs the process, ``servicer`` is the thin gRPC layer, ``worker`` owns
the engine loop and the request table, ``streams`` carries one request's tokens from the loop
to its caller, ``receiver`` takes in a pushed KV cache.
"""
