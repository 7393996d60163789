"""Provisioners: the interface, the local one, the kubernetes one and fault injection."""
