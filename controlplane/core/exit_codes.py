"""The CLI's exit codes, and the one mapping from the API's problem types to them (pure).

Scripts branch on these numbers; docs/api.md lists them (tests/unit/test_docs.py checks it).
"""

from __future__ import annotations

OK = 0
# Anything not named below: an internal error, a refusal without a more specific code.
OTHER = 1
# The command line or the request was not valid (argparse's own code for a usage error).
USAGE = 2
NOT_FOUND = 3
# A conflict with the current state: invalid state, deletion protection, a name in use, a
# precondition (If-Match) that no longer holds, a retry that cannot help.
CONFLICT = 4
# A --wait or `instances wait` that gave up at its --timeout (the operation may still finish).
TIMEOUT = 5
# The API could not be reached, or answered that it is unavailable or rate limited: try again later.
UNAVAILABLE = 6
# No key, a key not valid, or a key that may not do this (an organisation's key on an admin route).
UNAUTHORIZED = 7
# What was waited for cannot happen: the instance ended failed (or deleted while waiting for ready).
FAILED = 8
# `resize --wait` on a suspended instance: the change is recorded, applied once it resumes.
RECORDED = 9

# Name and meaning of each code, in the order docs/api.md lists them.
CODES: dict[int, tuple[str, str]] = {
    OK: ("ok", "done"),
    OTHER: ("other", "any other error"),
    USAGE: ("usage", "the command line or the request is not valid"),
    NOT_FOUND: ("not found", "no such instance, job, organisation or key (or an ambiguous name)"),
    CONFLICT: ("conflict", "not allowed in the current state, or a conflict with what exists"),
    TIMEOUT: ("timeout", "a wait gave up at its --timeout"),
    UNAVAILABLE: ("unavailable", "the API cannot be reached, is unavailable or rate limited"),
    UNAUTHORIZED: ("unauthorized", "no key, a key not valid, or a key not allowed to do this"),
    FAILED: ("failed", "what was waited for cannot happen: the instance ended failed"),
    RECORDED: ("recorded", "resize --wait on a suspended instance: the change waits for it to resume"),
}

# The exit code of each problem type (the part after urn:controlplane:problem:).
BY_PROBLEM: dict[str, int] = {
    "bad-request": USAGE,
    "bad-signature": USAGE,
    "validation": USAGE,
    "payload-too-large": USAGE,
    "unsupported-media-type": USAGE,
    "method-not-allowed": USAGE,
    "not-acceptable": USAGE,
    "idempotency-mismatch": USAGE,
    "unauthorized": UNAUTHORIZED,
    "forbidden": UNAUTHORIZED,
    "not-found": NOT_FOUND,
    "ambiguous-name": NOT_FOUND,
    "invalid-state": CONFLICT,
    "deletion-protected": CONFLICT,
    "not-retryable": CONFLICT,
    "already-replaced": CONFLICT,
    "name-taken": CONFLICT,
    "conflict": CONFLICT,
    "limit-reached": CONFLICT,
    "idempotency-in-flight": CONFLICT,
    "precondition-failed": CONFLICT,
    "busy": UNAVAILABLE,
    "rate-limited": UNAVAILABLE,
    "unavailable": UNAVAILABLE,
    "internal": OTHER,
}


def for_problem(kind: str | None, status: int) -> int:
    """The exit code of an API error: by its problem type, else by its HTTP status."""
    if kind in BY_PROBLEM:
        return BY_PROBLEM[kind]
    if status in (401, 403):
        return UNAUTHORIZED
    if status == 404:
        return NOT_FOUND
    if status in (409, 412):
        return CONFLICT
    if status in (429, 502, 503, 504):
        return UNAVAILABLE
    if 400 <= status < 500:
        return USAGE
    return OTHER


def for_domain_error(exc: Exception) -> int:
    """The exit code of a use case's refusal met on a direct path (the same as its problem type's:
    tests/unit/test_exit_codes.py checks the two agree)."""
    from controlplane.core import refusals as d

    if isinstance(exc, d.NotFound):
        return NOT_FOUND
    if isinstance(exc, d.InvalidState | d.Conflict | d.PreconditionFailed):
        return CONFLICT
    if isinstance(exc, d.InvalidRequest | d.Unsupported | d.IdempotencyMismatch):
        return USAGE
    return OTHER
