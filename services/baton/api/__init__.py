"""baton's wire contracts in Python.

``baton.api.v1`` is generated from ``proto/baton/v1`` by ``python -m baton.api.generate``
(``make proto``) and never edited by hand; ``baton.api.convert`` turns its messages into
domain objects and back, and ``baton.api.requests`` holds those domain objects.
"""
