"""What a use case refuses, and why (pure): one hierarchy that every entry point renders its own way.

The API maps each class to a problem+json kind in one place (`controlplane.api.problems`); the CLI
prints the message on one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class DomainError(Exception):
    """A request the domain refuses; `detail` is the sentence shown to the caller."""

    @property
    def detail(self) -> str:
        return str(self)


class NotFound(DomainError, LookupError):
    """The thing asked for does not exist (or is not the caller's to see)."""


class AmbiguousName(NotFound):
    """A name that several of the organisation's instances had, none of them live: use an id."""

    def __init__(self, message: str, *, candidates: Sequence[object]) -> None:
        super().__init__(message)
        self.candidates = [str(c) for c in candidates]


class InvalidState(DomainError):
    """Not allowed in the current state: says the state and what is allowed from it."""

    def __init__(self, message: str, *, current_state: str, allowed_actions: Sequence[str]) -> None:
        super().__init__(message)
        self.current_state = current_state
        self.allowed_actions = list(allowed_actions)


class DeletionProtected(InvalidState):
    """A deletion refused because the instance has deletion protection on."""


class NotRetryable(InvalidState):
    """A retry refused because the failure's reason says a retry cannot help."""

    def __init__(
        self,
        message: str,
        *,
        current_state: str,
        allowed_actions: Sequence[str],
        failure: Mapping[str, object],
    ) -> None:
        super().__init__(message, current_state=current_state, allowed_actions=allowed_actions)
        self.failure = dict(failure)


class Conflict(DomainError):
    """The request collides with something that exists."""


class NameTaken(Conflict):
    """A live instance of the organisation already has this name."""


class AlreadyReplaced(Conflict):
    """A failed instance retried once already: its replacement is named."""

    def __init__(self, message: str, *, replaced_by: object = None) -> None:
        super().__init__(message)
        self.replaced_by = replaced_by


class OrgExists(Conflict):
    """An organisation with this name or Stripe customer already exists."""


class LimitReached(Conflict):
    """The organisation holds as many of these as it may (API keys): one must go first."""


class PreconditionFailed(DomainError):
    """The caller asked against versions of the instance it no longer has."""

    def __init__(self, message: str, *, current_state: str, current_version: int) -> None:
        super().__init__(message)
        self.current_state = current_state
        self.current_version = current_version


class Unsupported(DomainError):
    """Something this installation cannot do (its provisioner does not): a request to change, not retry."""


class InvalidRequest(DomainError, ValueError):
    """A field of the request cannot be used as given (`location`: body, query or header)."""

    def __init__(self, field: str, message: str, *, location: str = "body") -> None:
        super().__init__(message)
        self.field = field
        self.location = location


class OutsideWindow(InvalidRequest):
    """A point in time a restore cannot reach: before the first backup held, or after the last
    moment archived (the window is None when nothing can be restored)."""

    def __init__(self, field: str, message: str, window: tuple[str | None, str | None] | None) -> None:
        super().__init__(field, message)
        self.window = window


class IdempotencyInFlight(Conflict):
    """A request with the same Idempotency-Key is still being processed."""


class IdempotencyMismatch(DomainError):
    """An Idempotency-Key used again with a different request."""
