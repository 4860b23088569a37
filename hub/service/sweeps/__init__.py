"""Hyperparameter sweeps: a set of ordinary jobs from one cell, searched and pruned by Optuna (see :mod:`.sweeps`)."""
