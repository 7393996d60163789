"""The audit log: hash chains, replay and verification, signed checkpoints, the signing key,
export and its offline verifier, search and dwell statistics.
"""
