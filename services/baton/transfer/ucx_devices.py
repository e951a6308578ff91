"""Which network devices a pod's NIXL agent lets UCX use (``UCX_NET_DEVICES``).

Left alone, UCX opens a TCP listener on every interface that has an address (measured here:
the host's external one beside loopback, for a pod bound to 127.0.0.1), where every other
listener of baton binds the one address it is configured with. A pod therefore gives UCX
the interface that carries its own listen address, plus the node's RDMA ports (the reason
to run NIXL at all; they are not IP interfaces, so an address cannot name them). Shared
memory and cross-memory copies on one host are not network devices and stay available.

An operator's own ``UCX_NET_DEVICES`` wins; a wildcard listen address (``0.0.0.0``, ``::``)
asks for every interface, and gets UCX's default.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "UCX_NET_DEVICES"
SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address
RDMA_DEVICES = Path("/sys/class/infiniband")
IPV6_ADDRESSES = Path("/proc/net/if_inet6")


def net_devices_for(host: str) -> str | None:
    """``UCX_NET_DEVICES`` for a pod listening on ``host`` (an address or a name): the
    interface carrying it and the node's RDMA ports. None: UCX's default (a wildcard host,
    or no interface here carries it)."""
    addresses = _addresses_of(host)
    if not addresses or any(address.is_unspecified for address in addresses):
        return None
    interfaces = sorted({name for name, address in _interface_addresses() if address in addresses})
    if not interfaces:
        log.warning("NIXL: no interface here carries %r: UCX may use every network device (set "
                    "%s to restrict it)", host, ENV)
        return None
    return ",".join(interfaces + rdma_ports())


def rdma_ports() -> list[str]:
    """The node's RDMA ports as UCX names them (``mlx5_0:1``)."""
    if not RDMA_DEVICES.is_dir():
        return []
    return sorted(f"{device.name}:{port.name}" for device in RDMA_DEVICES.iterdir()
                  for port in (device / "ports").glob("*") if port.name.isdigit())


@contextlib.contextmanager
def restricted_to(host: str | None) -> Iterator[str | None]:
    """Within the block (an agent's creation, when UCX reads its settings), UCX's network
    devices are ``host``'s (``net_devices_for``); the environment is as before after it.
    Yields what UCX was given (None: its default, or the operator's own setting)."""
    devices = None if host is None or ENV in os.environ else net_devices_for(host)
    if devices is None:
        yield None
        return
    os.environ[ENV] = devices
    try:
        yield devices
    finally:
        del os.environ[ENV]


def _addresses_of(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    host = host.strip("[]")
    if host in ("", "*"):
        return {ipaddress.ip_address("0.0.0.0")}
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}


def _interface_addresses() -> Iterator[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            yield name, ipaddress.IPv4Address(reply[20:24])
    if IPV6_ADDRESSES.exists():  # address, index, prefix, scope, flags, name
        for line in IPV6_ADDRESSES.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                yield fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0]))
