"""Checks shared by the tests of deploy/: Kubernetes manifests validated against their schemas, and the
memory sizes Kubernetes and Redis write in their own units."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate

#: The newest schemas kubernetes-validate ships (its version follows Kubernetes').
KUBERNETES_VERSION = "1.37.0"

_K8S_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
#: redis.conf's units: "1m" is 10^6 bytes, "1mb" 2^20 (case-insensitive).
_REDIS_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}


def k8s_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (``1Gi``, ``512M``, ``1073741824``) in bytes."""
    match = re.fullmatch(r"(\d+)([kMGT]i?|)", str(quantity))
    assert match is not None, f"not a memory quantity: {quantity!r}"
    return int(match.group(1)) * _K8S_UNITS[match.group(2)]


def redis_bytes(size: str) -> int:
    """A redis.conf memory size (``768mb``, ``1g``) in bytes."""
    match = re.fullmatch(r"(\d+)([a-z]*)", size.lower())
    assert match is not None and match.group(2) in _REDIS_UNITS, f"not a Redis memory size: {size!r}"
    return int(match.group(1)) * _REDIS_UNITS[match.group(2)]


def redis_option(args: list[str], name: str) -> str:
    """The value of ``--name`` on a ``redis-server`` command line."""
    flag = f"--{name}"
    assert flag in args, f"redis-server is not given {flag}: {args}"
    return args[args.index(flag) + 1]


def _validate_service_monitor(resource: dict[str, Any]) -> None:
    """prometheus-operator's ServiceMonitor, by the models generated from its CRD: every field known
    (a field the model does not know is dropped by the round trip) and every value of its type."""
    from cloudcoil.models.prometheus_operator import v1

    model = v1.ServiceMonitor.model_validate(resource)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == resource


#: Custom resources, validated by the schema of the operator that defines them.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): _validate_service_monitor}


def validate_manifest(resource: dict[str, Any]) -> None:
    """Raise unless ``resource`` is valid against its kind's schema, with no unknown field."""
    custom = CUSTOM_KINDS.get((resource.get("apiVersion", ""), resource.get("kind", "")))
    if custom is not None:
        custom(resource)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
