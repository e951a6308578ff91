"""Lease-based leader election: only one operator replica reconciles at a time.

The same protocol as client-go's leaderelection: a `coordination.k8s.io/v1`
Lease names its holder and when it last renewed. A candidate takes the Lease
when it is absent or has not been renewed for `leaseDurationSeconds`; the
holder renews it well inside that window. Every write carries the
resourceVersion that was read, so when two candidates race the API server
accepts one write and answers 409 to the other. A holder that fails to renew
stops reconciling at once and exits (its pod restarts as a candidate), so two
replicas never act together for longer than one renew interval.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable

from baton_operator.kube import Kube, KubeError

logger = logging.getLogger(__name__)


def _format(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime


def _parse(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)


class LeaseElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str,
                 lease_duration_s: int = 15,
                 clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(
                     datetime.UTC)):
        self.kube = kube
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration_s = lease_duration_s
        self.clock = clock

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this candidate holds the Lease afterwards."""
        now = self.clock()
        lease = self.kube.get("Lease", self.namespace, self.name)
        try:
            if lease is None:
                self.kube.create({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, acquired=now, transitions=0)})
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity", "")
            if holder == self.identity:
                acquired = _parse(spec["acquireTime"]) if spec.get("acquireTime") else now
                self._write(lease, self._spec(now, acquired, spec.get("leaseTransitions", 0)))
                return True
            if holder and not self._expired(spec, now):
                return False
            self._write(lease, self._spec(now, now, spec.get("leaseTransitions", 0) + 1))
            logger.info(f"took lease {self.namespace}/{self.name} from {holder or 'nobody'}")
            return True
        except KubeError as e:
            if e.status == 409:  # another candidate wrote first
                return False
            raise

    def _expired(self, spec: dict, now: datetime.datetime) -> bool:
        renewed = spec.get("renewTime")
        if not renewed:
            return True
        duration = spec.get("leaseDurationSeconds", self.lease_duration_s)
        return now > _parse(renewed) + datetime.timedelta(seconds=duration)

    def _spec(self, now: datetime.datetime, acquired: datetime.datetime, transitions: int) -> dict:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_duration_s,
                "acquireTime": _format(acquired), "renewTime": _format(now),
                "leaseTransitions": transitions}

    def _write(self, lease: dict, spec: dict) -> None:
        # The resourceVersion read makes the patch conditional: a racing write gets 409.
        meta = lease["metadata"]
        self.kube.patch("Lease", meta["namespace"], meta["name"], {
            "metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": spec})


async def run_as_leader(elector: LeaseElector, work: Callable[[asyncio.Event], Awaitable[None]],
                        retry_s: float) -> None:
    """Wait for the Lease, run ``work(stop_flag)`` while holding it; return when it is lost."""
    while not await asyncio.to_thread(elector.try_acquire_or_renew):
        await asyncio.sleep(retry_s)
    logger.info(f"{elector.identity} leads")
    stop_flag = asyncio.Event()
    task = asyncio.create_task(work(stop_flag))
    try:
        while not task.done():
            await asyncio.sleep(retry_s)
            held = await asyncio.to_thread(elector.try_acquire_or_renew)
            if not held:
                logger.error(f"{elector.identity} lost the lease; stopping")
                break
    finally:
        stop_flag.set()
        await task
