"""Provisioners: the interface, the local one, the kubernetes one and fault injection."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.runtime.settings import Settings
    from provisioners.base import Provisioner


def build(settings: Settings) -> Provisioner:
    """The provisioner `settings.provisioner.kind` names (local, kubernetes, noop).

    Wrapped in fault injection when faults are configured (CONTROLPLANE_FAULTS, read with the
    other settings at start): how a test tells a worker process where to fail or die.
    """
    from controlplane.core.faultspec import parse_faults
    from provisioners.faults import FaultyProvisioner

    inner = provisioner_class(settings.provisioner.kind).from_settings(settings)
    faults = parse_faults(settings.provisioner.faults)
    return FaultyProvisioner(inner, faults) if faults else inner


def provisioner_class(kind: str) -> type[Provisioner]:
    """The class of the provisioner `kind` names (what it can do is on the class)."""
    if kind == "local":
        from provisioners.local import LocalProvisioner

        return LocalProvisioner
    if kind == "kubernetes":
        from provisioners.kubernetes import KubernetesProvisioner

        return KubernetesProvisioner
    if kind == "noop":
        from provisioners.noop import NoopProvisioner

        return NoopProvisioner
    raise ValueError(f"unknown provisioner {kind!r}: expected local, kubernetes or noop")


def supports_restore(kind: str) -> bool:
    """Whether provisioner `kind` fills a new instance from another's backup (known without building one)."""
    return provisioner_class(kind).supports_restore


def supports_backups(kind: str) -> bool:
    """Whether provisioner `kind` takes the backups the control plane schedules and restores in place."""
    return provisioner_class(kind).supports_backups


def reports_windows(kind: str) -> bool:
    """Whether provisioner `kind` reports each instance's recoverable window (continuous archiving)."""
    return provisioner_class(kind).reports_windows
