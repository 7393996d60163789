"""The chaos soak (`python3 dev.py chaos --minutes N`): the control plane under load and faults.

`plan` holds the pure parts (the fault schedule, the invariants, the report), `soak` the processes,
the workload and the faults.
"""
