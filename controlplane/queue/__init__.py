"""The job queue's runtime: job moves, the registry, the worker, the supervisor, the event-log
consumers and the step records.
"""
