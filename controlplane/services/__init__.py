"""The use cases: one function per thing a caller can ask, called by every entry point.

Each takes a connection, the actor, the request id and a typed request, and returns a typed
result or raises a `controlplane.core.refusals.DomainError`. None of them knows HTTP.
"""
