"""What the worker runs: the instance operations, abandonment hooks, usage reports and
notification delivery.
"""
