"""kopf handlers: every event that can change what a `BatonService` needs runs one reconcile.

Reconcile is level-based (it reads current state and writes only differences),
so the handlers are plain event handlers rather than kopf's create/update
state machine: a service event, a pool being scaled, a child's readiness
changing, or the periodic resync all lead to the same pass. A lock per
service keeps two passes for one service from racing each other; the
deletion handler holds kopf's finalizer until the children are gone.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import kopf

from baton_operator.autoscaler import Autoscaler
from baton_operator.reconcile import Reconciler
from baton_operator.spec import InvalidSpec, read_spec

GROUP = "baton.dev"
VERSION = "v1alpha1"
RESYNC_INTERVAL_S = 30.0
AUTOSCALE_TICK_S = 5.0  # each service's planner acts on its own spec.autoscaling.intervalSeconds
FINALIZER = "baton.dev/cleanup"


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf's own bookkeeping goes into baton.dev annotations, not into our status schema."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # Kubernetes Events only for trouble
    # Discover resources once at startup instead of watching CRDs and namespaces:
    # that would need cluster-wide read access the RBAC does not grant.
    settings.scanning.disabled = True


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler,
             autoscaler: Autoscaler | None = None,
             autoscale_tick_s: float = AUTOSCALE_TICK_S) -> None:
    """Attach baton's handlers to ``registry`` (a fresh one per operator or per test); with
    an ``autoscaler``, services with ``spec.autoscaling.enabled`` are sized by its planner,
    which kopf's timer offers a step every ``autoscale_tick_s``."""
    locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
    kube = reconciler.kube

    def reconcile(namespace: str, name: str, logger: Any) -> None:
        with locks[namespace, name]:
            service = kube.get("BatonService", namespace, name)  # the latest, not the event's
            if service is None or service["metadata"].get("deletionTimestamp"):
                return
            try:
                status = reconciler.reconcile(service)
            except InvalidSpec as e:
                logger.error(f"invalid spec: {e}")
                reconciler.record_invalid(service, e)
                return
            logger.debug(f"reconciled: {status['conditions'][0]['message']}")

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings)

    @kopf.on.event(GROUP, VERSION, "batonservices", registry=registry)
    def service_changed(event: dict, logger: Any, **_: Any) -> None:
        if event["type"] == "DELETED":
            return
        meta = event["object"]["metadata"]
        reconcile(meta["namespace"], meta["name"], logger)

    @kopf.timer(GROUP, VERSION, "batonservices", interval=RESYNC_INTERVAL_S, registry=registry)
    def resync(namespace: str, name: str, logger: Any, **_: Any) -> None:
        reconcile(namespace, name, logger)

    if autoscaler is not None:
        @kopf.timer(GROUP, VERSION, "batonservices", interval=autoscale_tick_s, registry=registry)
        def autoscale(namespace: str, name: str, logger: Any, **_: Any) -> None:
            with locks[namespace, name]:
                service = kube.get("BatonService", namespace, name)
                if service is None or service["metadata"].get("deletionTimestamp"):
                    return
                try:
                    spec = read_spec(service.get("spec") or {}, reconciler.default_image)
                except InvalidSpec:
                    return  # the reconcile reports it
                decision = autoscaler.tick(service, spec)
            if decision is not None and decision.changed:
                reconcile(namespace, name, logger)

    @kopf.on.event(GROUP, VERSION, "batonpools", registry=registry)
    def pool_changed(event: dict, logger: Any, **_: Any) -> None:
        pool = event["object"]
        if event["type"] != "DELETED" and pool.get("spec", {}).get("service"):
            reconcile(pool["metadata"]["namespace"], pool["spec"]["service"], logger)

    for group_version, plural in (("apps/v1", "deployments"), ("apps/v1", "statefulsets")):
        @kopf.on.event(group_version, plural, registry=registry,
                       labels={"app.kubernetes.io/managed-by": "baton-operator"})
        def child_changed(event: dict, logger: Any, **_: Any) -> None:
            meta = event["object"]["metadata"]
            reconcile(meta["namespace"], meta["labels"]["baton.dev/service"], logger)

    @kopf.on.delete(GROUP, VERSION, "batonservices", registry=registry)
    def service_deleted(namespace: str, name: str, logger: Any, **_: Any) -> None:
        with locks[namespace, name]:
            removed = reconciler.delete(name, namespace)
            if autoscaler is not None:
                autoscaler.forget(namespace, name)
        locks.pop((namespace, name), None)
        logger.info(f"removed {removed} children")
