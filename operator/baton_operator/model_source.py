"""Where a `BatonService`'s pods get their model: ``spec.model.uri``, read and rendered.

    (empty)                  the small model shipped in the image
    hf://org/name[@revision] a Hugging Face repo: an init container (`baton fetch-model`)
                             puts it into the pod's model cache (HF_HOME) unless it is
                             there already; the servers then read that snapshot offline
    pvc://claim[/path]       a checkpoint directory on a PersistentVolumeClaim, read-only
    host:///directory        a checkpoint directory on the node

An ``hf://`` model's cache is ``spec.model.cache.claimName`` when given, one claim every
pod shares (the model is downloaded once for all of them), else an emptyDir per pod
(downloaded once per pod; a restarted container finds it). Gateways fetch the config
and tokenizer only: they never read the weights. The token of a gated repo comes from
``spec.model.tokenSecret`` into the init container alone.

A directory on a claim or the node is mounted whole and read by its own name (its last
path component), which is what clients call it unless ``servedModelName`` says otherwise.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from baton.config import ModelSourceConfig

MODELS_DIR = "/models"
HF_HOME = f"{MODELS_DIR}/hf"  # the Hugging Face cache of an hf:// model
CLAIM_DIR = f"{MODELS_DIR}/pvc"  # a pvc:// model's claim, mounted whole
HOST_DIR = f"{MODELS_DIR}/host"
TOKEN_KEY = "token"  # the Secret key holding HF_TOKEN when tokenSecret names none
SCHEMES = ("hf", "pvc", "host")

# What the Hub accepts as org/name; a revision is a branch, tag or commit (refs/pr/1 too).
_HF_URI = re.compile(r"hf://(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                     r"(?:@(?P<revision>[\w.][\w./-]*))?")
_CLAIM = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # a DNS subdomain name
_PVC_URI = re.compile(r"pvc://(?P<claim>[^/]+)(?P<path>/.*)?")
_HOST_URI = re.compile(r"host://(?P<path>/.*)")


@dataclass(frozen=True)
class ModelSource:
    scheme: str = ""  # "" (the shipped model), or one of SCHEMES
    location: str = ""  # the repo id, the claim's name, or the node's directory
    sub_path: str = ""  # pvc: the checkpoint's directory inside the claim ("" = its root)
    token_secret_name: str = ""  # hf: the Secret holding HF_TOKEN, and its key
    token_secret_key: str = TOKEN_KEY
    cache_claim_name: str = ""  # hf: the claim holding the cache ("" = an emptyDir per pod)
    cache_size_limit: str = ""  # hf: the emptyDir's size limit
    offline: bool = False  # hf: the cache must hold the model already (HF_HUB_OFFLINE)
    config: ModelSourceConfig = field(default_factory=ModelSourceConfig)


def parse_uri(uri: str) -> tuple[str, str, str, str]:
    """``(scheme, location, sub_path, revision)`` of a model URI; raises ValueError saying
    which forms are accepted."""
    forms = "hf://org/name[@revision], pvc://claim[/path] or host:///directory (empty: " \
            "the shipped model)"
    if not uri:
        return "", "", "", ""
    if match := _HF_URI.fullmatch(uri):
        return "hf", match["repo"], "", match["revision"] or ""
    if match := _PVC_URI.fullmatch(uri):
        if not _CLAIM.fullmatch(match["claim"]):
            raise ValueError(f"{match['claim']!r} is not a PersistentVolumeClaim name")
        return "pvc", match["claim"], _relative(match["path"] or "/"), ""
    if match := _HOST_URI.fullmatch(uri):
        path = "/" + _relative(match["path"])
        if path == "/":
            raise ValueError("host:// needs the checkpoint's directory, not the node's root")
        return "host", path, "", ""
    raise ValueError(f"is not a model URI: give {forms}")


def _relative(path: str) -> str:
    """``/a/b/`` -> ``a/b``; refuses ``..`` (a mount must not reach out of its volume)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"the path {path!r} must not contain '..'")
    return "/".join(parts)


# ---- what a pod gets -------------------------------------------------------------------------


def served_path(source: ModelSource) -> tuple[str, str]:
    """``(model.path, model.revision)`` the servers are started with."""
    revision = source.config.revision
    if source.scheme == "hf":  # resolved in the fetched cache (baton.model.hub)
        return source.location, revision
    if source.scheme == "pvc":
        return posixpath.join(CLAIM_DIR, source.sub_path).rstrip("/"), revision
    if source.scheme == "host":
        return posixpath.join(HOST_DIR, posixpath.basename(source.location)), revision
    return "", revision


def model_volumes(source: ModelSource) -> tuple[list[dict], list[dict]]:
    """The model's volume and the servers' read-only mount of it."""
    if source.scheme == "hf":
        return [_cache_volume(source)], [{"name": "model", "mountPath": HF_HOME, "readOnly": True}]
    if source.scheme == "pvc":
        volume = {"persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}
        mount_path = CLAIM_DIR
    elif source.scheme == "host":
        volume = {"hostPath": {"path": source.location, "type": "Directory"}}
        mount_path = served_path(source)[0]
    else:
        return [], []
    return [{"name": "model", **volume}], [{"name": "model", "mountPath": mount_path,
                                            "readOnly": True}]


def _cache_volume(source: ModelSource) -> dict:
    if source.cache_claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.cache_claim_name}}
    empty_dir = {"sizeLimit": source.cache_size_limit} if source.cache_size_limit else {}
    return {"name": "model", "emptyDir": empty_dir}


def server_env(source: ModelSource) -> list[dict]:
    """The servers read the fetched snapshot and never reach the Hub themselves."""
    if source.scheme != "hf":
        return []
    return [{"name": "HF_HOME", "value": HF_HOME}, {"name": "HF_HUB_OFFLINE", "value": "1"}]


def fetch_container(source: ModelSource, role: str) -> dict | None:
    """The init container that fetches an hf:// model into the cache (image and security
    context are the pod's, added by the caller); None for any other source."""
    if source.scheme != "hf":
        return None
    args = ["fetch-model", source.location]
    if source.config.revision:
        args += ["--revision", source.config.revision]
    if role == "gateway":
        args.append("--without-weights")
    env = [{"name": "HF_HOME", "value": HF_HOME}, {"name": "HOME", "value": "/tmp"}]
    if source.offline:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if source.token_secret_name:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": source.token_secret_name, "key": source.token_secret_key}}})
    return {"name": "fetch-model", "args": args, "env": env,
            "volumeMounts": [{"name": "model", "mountPath": HF_HOME},
                             {"name": "tmp", "mountPath": "/tmp"}]}
