"""Whether a BatonService's chains and decode pods will publish KV contracts that fit.

The operator builds both roles' settings from one spec (one model, revision, dtype and
compression), so they agree unless a role's pod overlay sets one of them in its environment
(``spec.<role>.pod.env``: ``BATON_MODEL_DTYPE`` on the decode pods only, say), which a server
reads where no flag gives the setting. This resolves each role's settings as its server will
(flags, then that environment, then defaults: ``baton.configtree``) and compares them by the
one rule the gateway routes by (``baton.kv.contract``). What only a started pod knows
(``dtype auto`` resolved on a node of another kind, a rollout between releases) shows in the
gateway's route reasons and its ``baton_gateway_kv_contract_mismatches_total`` instead.
"""

from __future__ import annotations

import argparse
from typing import Any

from baton.configtree import add_arguments, from_arguments
from baton.kv.contract import KVContract, compression_of

from baton_operator.service_configs import config_arguments, decode_config, prefill_config
from baton_operator.spec import ServiceSpec


def role_contract(config: Any, env: list[dict]) -> KVContract:
    """What a role's server started with ``config``'s flags and ``env`` will publish, as far
    as its settings decide it (the dtype ``auto`` resolves to is not said)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, type(config))
    environ = {item["name"]: str(item["value"]) for item in env if "value" in item}
    resolved = from_arguments(parser.parse_args(config_arguments(config)), type(config), environ=environ)
    model = resolved.model
    return KVContract(model.path, model.revision, dtype="" if model.dtype == "auto" else model.dtype,
                      compression=compression_of(resolved.pyramid))


def mismatches(name: str, namespace: str, spec: ServiceSpec) -> list[str]:
    """Why the service's chains would ship KV its decode pods do not take, in words (empty:
    none the operator can see)."""
    try:
        chain = role_contract(prefill_config(name, namespace, spec, 0), spec.pods["prefill"].env)
        pod = role_contract(decode_config(name, namespace, spec), spec.pods["decode"].env)
    except ValueError:  # an overlay's value the server refuses: its pods fail to start and say so
        return []
    return chain.mismatches(pod)
