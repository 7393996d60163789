"""Drivers for the peer queues: run by bench/.venv's python (never the project's), print JSON results."""
