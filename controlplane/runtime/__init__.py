"""Process plumbing under everything: settings, logs, metrics, secrets, TLS, files, and the
control of a PostgreSQL server on this machine (the embedded database).
"""
