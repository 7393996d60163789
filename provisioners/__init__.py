"""Provisioners: the interface, the local one, the kubernetes one and fault injection."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.settings import Settings
    from provisioners.base import Provisioner


def build(settings: Settings) -> Provisioner:
    """The provisioner `settings.provisioner.kind` names (local, kubernetes, noop).

    Wrapped in fault injection when faults are configured (CONTROLPLANE_FAULTS, read with the
    other settings at start): how a test tells a worker process where to fail or die.
    """
    from provisioners.faults import FaultyProvisioner, parse_faults

    inner: Provisioner
    if settings.provisioner.kind == "local":
        from provisioners.local import LocalProvisioner

        inner = LocalProvisioner(settings)
    elif settings.provisioner.kind == "kubernetes":
        from provisioners.kubernetes import KubernetesProvisioner

        inner = KubernetesProvisioner.from_settings(settings)
    elif settings.provisioner.kind == "noop":
        from provisioners.noop import NoopProvisioner

        inner = NoopProvisioner()
    else:
        raise ValueError(
            f"unknown provisioner {settings.provisioner.kind!r}: expected local, kubernetes or noop"
        )
    faults = parse_faults(settings.provisioner.faults)
    return FaultyProvisioner(inner, faults) if faults else inner
