"""Leader election over a Lease in kmock's emulator: one candidate acts, the other takes over
only when the leader stops renewing, and a deposed leader stops its work."""

from __future__ import annotations

import asyncio
import datetime

from baton_operator.leader import LeaseElector, run_as_leader

NS = "baton-system"


class Clock:
    def __init__(self):
        self.now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

    def __call__(self):
        return self.now

    def advance(self, seconds: float):
        self.now += datetime.timedelta(seconds=seconds)


def test_only_one_candidate_holds_the_lease(cluster):
    clock = Clock()
    first, second = (LeaseElector(cluster.kube, NS, "baton-operator", who, 15, clock)
                     for who in ("operator-a", "operator-b"))
    assert first.try_acquire_or_renew()
    assert not second.try_acquire_or_renew()

    clock.advance(10)
    assert first.try_acquire_or_renew()  # renewed inside the window
    clock.advance(10)
    assert not second.try_acquire_or_renew()  # 10 s since the renewal: still held

    clock.advance(6)  # the leader went silent for 16 s > 15 s
    assert second.try_acquire_or_renew()
    assert not first.try_acquire_or_renew()
    lease = cluster.kube.get("Lease", NS, "baton-operator")["spec"]
    assert lease["holderIdentity"] == "operator-b" and lease["leaseTransitions"] == 1


def test_a_deposed_leader_stops_its_work(cluster):
    # The leader's clock stands still, as if its renewals stalled; the other's moves on.
    leader_clock, usurper_clock = Clock(), Clock()
    leader = LeaseElector(cluster.kube, NS, "baton-operator", "operator-a", 15, leader_clock)
    usurper = LeaseElector(cluster.kube, NS, "baton-operator", "operator-b", 15, usurper_clock)
    stopped = []

    def holder() -> str | None:
        try:
            return cluster.kube.get("Lease", NS, "baton-operator")["spec"]["holderIdentity"]
        except Exception:  # noqa: BLE001 - no lease yet
            return None

    async def work(stop_flag: asyncio.Event):
        await stop_flag.wait()
        stopped.append(True)

    async def scenario():
        running = asyncio.create_task(run_as_leader(leader, work, retry_s=0.05))
        deadline = asyncio.get_running_loop().time() + 10
        while await asyncio.to_thread(holder) != "operator-a":  # until it leads
            assert asyncio.get_running_loop().time() < deadline, "operator-a never took the lease"
            await asyncio.sleep(0.01)
        assert not running.done() and not stopped  # leading and working
        usurper_clock.advance(60)
        assert await asyncio.to_thread(usurper.try_acquire_or_renew)
        # it renews every 0.05 s: the bound is for a machine running other suites beside it
        await asyncio.wait_for(running, timeout=30)

    asyncio.run(scenario())
    assert stopped == [True]
