"""The gateway: the client API in front of prefill chains and decode pods (docs/architecture.md).

``server`` builds the gRPC server and the OpenAI HTTP API (``http/``), both thin doors to
``generations`` (admit, route, stream, abort one request); ``servicer`` is the gRPC one, ``relay`` moves
one request through the pods the routing policy picked (``routing_policy`` + ``policies/``),
and ``request_table`` remembers where each request lives. The whole service on one machine
(``baton up``) is ``baton.local``; API keys and mTLS are ``baton.security``.
"""
