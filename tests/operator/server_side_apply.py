"""Server-side apply for the emulated cluster (kmock merges every PATCH into the object).

What an apply does on a real API server, for maps and atomic lists: the manager's applied
configuration is merged into the live object; every field it names becomes the manager's;
a field the manager owned and no longer names is removed; fields of other managers stay.
Ownership is recorded in ``metadata.managedFields`` as the API server records it (an
``Apply`` entry per manager, ``fieldsType: FieldsV1``).

Simplified: every list is atomic, owned whole by the manager that set it last (the API
server merges a few, such as containers or env, by their key); ownership taken over by a
non-apply write of another manager is not tracked (a forced apply takes it back anyway).
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]


def leaf_paths(node: Any, prefix: Path = ()) -> set[Path]:
    """The paths of ``node``'s leaves: scalars, lists and empty maps."""
    if isinstance(node, dict) and node:
        return set().union(*(leaf_paths(value, (*prefix, key)) for key, value in node.items()))
    return {prefix}


def _fields_v1(paths: set[Path]) -> dict:
    tree: dict = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _paths(fields_v1: dict, prefix: Path = ()) -> set[Path]:
    if not fields_v1:
        return {prefix}
    return set().union(*(_paths(child, (*prefix, key[2:])) for key, child in fields_v1.items()))


def owned(obj: dict | None, manager: str) -> set[Path]:
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        if entry["manager"] == manager and entry["operation"] == "Apply":
            return _paths(entry["fieldsV1"])
    return set()


def _remove(obj: dict, path: Path, keep: dict) -> None:
    """Delete ``path`` from ``obj``, and the maps it leaves empty that ``keep`` lacks."""
    *parents, leaf = path
    nodes = [obj]
    for key in parents:
        child = nodes[-1].get(key)
        if not isinstance(child, dict):
            return
        nodes.append(child)
    nodes[-1].pop(leaf, None)
    for depth in range(len(parents), 0, -1):
        kept: Any = keep
        for key in parents[:depth]:
            kept = kept.get(key) if isinstance(kept, dict) else None
        if nodes[depth] or kept is not None:
            break
        nodes[depth - 1].pop(parents[depth - 1])


def _merge(into: dict, applied: dict) -> None:
    for key, value in applied.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def apply(live: dict | None, applied: dict, manager: str, now: str) -> dict:
    """The object once ``manager`` has applied ``applied`` to ``live`` (None: a new one)."""
    applied = copy.deepcopy(applied)
    applied.get("metadata", {}).pop("managedFields", None)
    result = copy.deepcopy(live or {})
    naming = leaf_paths(applied) - {("apiVersion",), ("kind",)}  # as the API server records
    for path in owned(live, manager) - naming:
        _remove(result, path, applied)
    _merge(result, applied)
    entries = [e for e in result["metadata"].get("managedFields") or []
               if (e["manager"], e["operation"]) != (manager, "Apply")]
    entries.append({"manager": manager, "operation": "Apply",
                    "apiVersion": applied["apiVersion"], "time": now,
                    "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(naming)})
    result["metadata"]["managedFields"] = entries
    return result


def merge_patch(live: Any, wanted: Any) -> Any:
    """The RFC 7386 merge patch that turns ``live`` into ``wanted`` (what kmock stores)."""
    if not isinstance(live, dict) or not isinstance(wanted, dict):
        return wanted
    patch: dict = {key: None for key in live if key not in wanted}
    for key, value in wanted.items():
        if key not in live or live[key] != value:
            patch[key] = merge_patch(live.get(key), value)
    return patch
