"""The control plane: lifecycles, persistence, job queue, API, billing and CLI."""
