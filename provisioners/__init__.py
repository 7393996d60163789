"""Provisioners: the interface, the local one, the kubernetes one and fault injection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.settings import Settings
    from provisioners.base import Provisioner


def build(settings: Settings, environ: Mapping[str, str] | None = None) -> Provisioner:
    """The provisioner `settings.provisioner` names (local, kubernetes, noop).

    Wrapped in fault injection when faults are configured (settings.extra["faults"] or the
    CONTROLPLANE_FAULTS variable): how a test tells a worker process where to fail or die.
    """
    from provisioners.faults import FaultyProvisioner, faults_from

    inner: Provisioner
    if settings.provisioner == "local":
        from provisioners.local import LocalProvisioner

        inner = LocalProvisioner(settings)
    elif settings.provisioner == "kubernetes":
        from provisioners.kubernetes import KubernetesProvisioner

        inner = KubernetesProvisioner.from_settings(settings)
    elif settings.provisioner == "noop":
        from provisioners.noop import NoopProvisioner

        inner = NoopProvisioner()
    else:
        raise ValueError(f"unknown provisioner {settings.provisioner!r}: expected local, kubernetes or noop")
    faults = faults_from(settings.extra, environ)
    return FaultyProvisioner(inner, faults) if faults else inner


# The provisioners whose allocate_storage restores from a backup (their class's supports_restore;
# known by name so that the API can refuse a restore without building a provisioner).
RESTORING = frozenset({"kubernetes"})


def supports_restore(name: str) -> bool:
    return name in RESTORING
