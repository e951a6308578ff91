"""baton's Kubernetes operator: one `BatonService` becomes prefill chains, decode
workers, a gateway and (optionally) Redis; `BatonPool`s let `kubectl scale` and
HPAs resize the prefill and decode roles. Run it as ``python -m baton_operator``.
"""
