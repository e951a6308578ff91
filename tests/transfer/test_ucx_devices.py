"""UCX's network devices for a pod's NIXL agent: the interface of its listen address and the
node's RDMA ports, never every interface unasked."""

import os
from pathlib import Path

import pytest
from baton.transfer import ucx_devices
from baton.transfer.ucx_devices import ENV, net_devices_for, restricted_to

UNASSIGNED = "203.0.113.77"  # TEST-NET-3: no interface here carries it
IPV6_LOOPBACK = pytest.mark.skipif(  # a host may run with IPv6 off
    "0" * 31 + "1" not in (Path("/proc/net/if_inet6").read_text()
                           if Path("/proc/net/if_inet6").exists() else ""),
    reason="no interface here carries ::1 (IPv6 is off)")


@pytest.fixture(autouse=True)
def no_operator_setting(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("[::1]", marks=IPV6_LOOPBACK),
                                  "localhost"])
def test_a_loopback_address_gives_the_loopback_interface_only(host):
    assert net_devices_for(host) == "lo"


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "", "*"])
def test_a_wildcard_address_leaves_ucx_its_default(host):
    assert net_devices_for(host) is None


def test_an_address_no_interface_carries_leaves_ucx_its_default():
    assert net_devices_for(UNASSIGNED) is None
    assert net_devices_for("no-such-host.invalid") is None


def test_the_nodes_rdma_ports_come_along(tmp_path, monkeypatch):
    for device, ports in (("mlx5_0", ("1",)), ("mlx5_1", ("1", "2"))):
        for port in ports:
            (tmp_path / device / "ports" / port).mkdir(parents=True)
    monkeypatch.setattr(ucx_devices, "RDMA_DEVICES", tmp_path)
    assert net_devices_for("127.0.0.1") == "lo,mlx5_0:1,mlx5_1:1,mlx5_1:2"


def test_the_restriction_holds_within_the_block_only():
    with restricted_to("127.0.0.1") as devices:
        assert devices == "lo" and os.environ[ENV] == "lo"
    assert ENV not in os.environ


def test_an_operators_own_setting_wins(monkeypatch):
    monkeypatch.setenv(ENV, "eth1")
    with restricted_to("127.0.0.1") as devices:
        assert devices is None and os.environ[ENV] == "eth1"
    assert os.environ[ENV] == "eth1"


def test_no_host_or_no_interface_changes_nothing(caplog):
    with restricted_to(None) as devices:
        assert devices is None and ENV not in os.environ
    with restricted_to(UNASSIGNED) as devices:
        assert devices is None and ENV not in os.environ
    assert UNASSIGNED in caplog.text and ENV in caplog.text
