"""Benchmarks (not tests): the control plane's figures as ratios to PostgreSQL's limit and to peer queues."""
