"""``spec.mtls``: where each role's internal certificates come from."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_operator.spec_reading import InvalidSpec, section_of

MTLS_ROLES = ("gateway", "prefill", "decode")  # the pods that speak baton's internal gRPC


@dataclass(frozen=True)
class MtlsSpec:
    """Where each role's internal certificates come from: one Secret per role (the same
    Secret for every role when one is shared), or none at all when ``insecure``."""

    secret_names: dict[str, str] = field(default_factory=dict)  # role -> Secret
    insecure: bool = False


def read_mtls(spec: dict) -> MtlsSpec:
    """Certificates for every role, or an explicit ``insecure``: never neither, because the
    services refuse to start without one (``baton.security.mtls.Mtls.check_service``)."""
    mtls = section_of(spec, "mtls")
    insecure = mtls.get("insecure", False)
    if not isinstance(insecure, bool):
        raise InvalidSpec(f"spec.mtls.insecure must be true or false, got {insecure!r}")
    shared = mtls.get("secretName") or ""
    per_role = mtls.get("secretNames") or {}
    if not isinstance(per_role, dict) or set(per_role) - set(MTLS_ROLES):
        raise InvalidSpec(f"spec.mtls.secretNames takes only {', '.join(MTLS_ROLES)}, got {per_role!r}")
    names = {role: per_role.get(role) or shared for role in MTLS_ROLES}
    for role, name in names.items():
        if not isinstance(name, str):
            raise InvalidSpec(f"spec.mtls: the Secret for {role} pods must be a name, got {name!r}")
    if insecure:
        if any(names.values()):
            raise InvalidSpec("spec.mtls.insecure is true but spec.mtls also names Secrets: "
                              "choose certificates or plaintext, not both")
        return MtlsSpec(insecure=True)
    missing = [role for role, name in names.items() if not name]
    if missing:
        raise InvalidSpec(f"spec.mtls names no Secret for {', '.join(missing)} pods: give "
                          f"spec.mtls.secretName (every pod) or spec.mtls.secretNames.<role>, "
                          f"Secrets with ca.crt, tls.crt and tls.key, or set spec.mtls.insecure: "
                          f"true for plaintext internal calls")
    return MtlsSpec(secret_names=names)
