"""The pure core: lifecycle tables, records, job kinds, plans, retry, billing rules, failures.

Nothing here does I/O or imports a framework or driver (an import-linter contract).
"""
