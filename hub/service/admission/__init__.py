"""Kueue's semantics in memory: quotas, cohorts, borrowing, priorities, preemption. Pure: no database, no
clock, no I/O; it imports only the service's leaf modules.
"""
