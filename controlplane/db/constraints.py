"""Unique violations translated into the domain errors they mean, by constraint name, in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import psycopg

from controlplane.core.refusals import AlreadyReplaced, DomainError, NameTaken, OrgExists

# Constraint (or unique index) name -> the refusal, from what the caller was creating.
UNIQUE: Mapping[str, Callable[[Mapping[str, object]], DomainError]] = MappingProxyType(
    {
        "ux_instances_live_name": lambda asked: NameTaken(
            f"a live instance named {asked.get('name')!r} already exists in this organisation"
        ),
        "ux_instances_replaces": lambda asked: AlreadyReplaced(
            f"instance {asked.get('replaces')} has been retried already"
        ),
        "uq_organisations_name": lambda _: OrgExists("an organisation with this name already exists"),
        "uq_organisations_stripe_customer_id": lambda _: OrgExists(
            "an organisation with this Stripe customer already exists"
        ),
    }
)


@contextlib.contextmanager
def unique_violations(**asked: object) -> Iterator[None]:
    """Around a write: a unique violation of a known constraint becomes its domain error.

    Use it outside the transaction of the write, so that the transaction has rolled back.
    """
    try:
        yield
    except psycopg.errors.UniqueViolation as exc:
        refusal = UNIQUE.get(exc.diag.constraint_name or "")
        if refusal is None:
            raise
        raise refusal(asked) from None
