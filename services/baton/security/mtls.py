"""Mutual TLS between baton's pods: who may call an internal port, and how a pod calls one.

Every internal hop (gateway -> decode, gateway -> prefill, prefill tail -> decode) is TLS
with certificates from one CA (``mtls.ca``), both ways: the server requires a client
certificate from that CA, and the client verifies the server's. A pod's certificate
(``mtls.cert``/``mtls.key``) serves as both. Its common name says its role,
``baton-<role>`` (``baton-internal`` for one certificate shared by every pod, e.g. a
single Secret), and servers check it per method (``require_role``): a decode pod takes
KV pushes only from prefill ranks, Attach and Generate only from gateways.

Pods are reached by IP, and one certificate may serve many pods, so a server's name is
not its address: every internal certificate carries the DNS name ``INTERNAL_SERVER_NAME``
and channels check that name (``grpc.ssl_target_name_override``).

Rotation without a restart: servers re-read the files at the next handshake once they
changed (``grpc.dynamic_ssl_server_credentials``); clients compare ``fingerprint()`` and
open new channels when it moved.

Plaintext only when asked (``mtls.insecure``): a service started without certificates and
without that flag refuses to start (``check_service``).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import grpc

from baton import files
from baton.config import MtlsConfig
from baton.errors import PermissionDenied

log = logging.getLogger(__name__)

INTERNAL_SERVER_NAME = "baton.internal"
ROLE_PREFIX = "baton-"
SHARED_ROLE = "internal"  # a certificate every pod shares: any internal role


ROTATION_CHECK_S = 1.0  # how often callers look at the files for a rotation


class Mtls:
    def __init__(self, config: MtlsConfig) -> None:
        self.config = config
        self._fingerprint: tuple = ()
        self._checked_at = -math.inf

    @property
    def enabled(self) -> bool:
        return bool(self.config.cert) and not self.config.insecure

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.config.ca).read_bytes(), Path(self.config.key).read_bytes(),
                Path(self.config.cert).read_bytes())

    def fingerprint(self) -> tuple:
        """The files' ``change_fingerprint``: moves when any of them changes; read at most
        every ``ROTATION_CHECK_S`` (callers ask on every call they open)."""
        if not self.enabled:
            return ()
        now = time.monotonic()
        if now - self._checked_at >= ROTATION_CHECK_S:
            self._fingerprint, self._checked_at = files.change_fingerprint(
                self.config.ca, self.config.cert, self.config.key), now
        return self._fingerprint

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that require a client certificate from the CA and pick up rotated
        files at the next handshake."""
        return reloading_server_credentials(self.config.key, self.config.cert, self.config.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, key, cert = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel(self, address: str, options: list, aio: bool = False):
        """A channel to an internal server: mTLS when enabled, plaintext otherwise."""
        module = grpc.aio if aio else grpc
        if not self.enabled:
            return module.insecure_channel(address, options=options)
        options = [*options, ("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME)]
        return module.secure_channel(address, self.channel_credentials(), options=options)

    def check_service(self, command: str) -> None:
        """Refuse to run a service with neither certificates nor an explicit ``insecure``."""
        if not self.config.cert and not self.config.insecure:
            raise ValueError(f"`baton {command}` needs mTLS certificates (--mtls-ca, --mtls-cert, "
                             f"--mtls-key) or, to talk plaintext, --mtls-insecure")
        if self.config.insecure:
            log.warning("mTLS OFF: internal calls are plaintext and unauthenticated (--mtls-insecure)")


def reloading_server_credentials(key: str, cert: str, ca: str = "") -> grpc.ServerCredentials:
    """TLS server credentials from files, re-read at the next handshake once any changed (a
    renewed Secret applies without a restart); with ``ca``, clients must present a
    certificate it signed (mTLS)."""
    paths = [path for path in (ca, cert, key) if path]

    def configuration():
        return grpc.ssl_server_certificate_configuration(
            [(Path(key).read_bytes(), Path(cert).read_bytes())],
            root_certificates=Path(ca).read_bytes() if ca else None)

    seen = [files.change_fingerprint(*paths)]

    def fetch():
        try:
            current = files.change_fingerprint(*paths)
            if current == seen[0]:
                return None
            fresh = configuration()
        except OSError as e:  # a rotation half written: keep the last files
            log.warning("TLS files unreadable, keeping the last ones: %s", e)
            return None
        seen[0] = current
        log.info("TLS certificate reloaded from %s", cert)
        return fresh

    return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                               require_client_authentication=bool(ca))


def peer_role(context) -> str | None:
    """The role in the caller's certificate (``baton-<role>``); None without mTLS."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    for name in names:
        text = name.decode() if isinstance(name, bytes) else name
        if text.startswith(ROLE_PREFIX):
            return text[len(ROLE_PREFIX):]
    return None


def require_role(context, mtls: Mtls, allowed: tuple[str, ...], what: str) -> None:
    """Raise PermissionDenied unless the caller's certificate names one of ``allowed`` (or
    the shared internal role); nothing is checked when mTLS is off."""
    if not mtls.enabled:
        return
    role = peer_role(context)
    if role not in allowed and role != SHARED_ROLE:
        raise PermissionDenied(f"{what} is for {', '.join(allowed)} pods; the caller's certificate "
                               f"names {role or 'no baton role'}")
