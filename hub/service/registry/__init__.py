"""Model versions registered from jobs' runs: evaluations that gate approval, decisions, aliases, lineage.
Above jobs: an evaluation is a job.
"""
