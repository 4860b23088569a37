"""The job runner: one attempt of a job, on the job's side of the boundary.

``python -m danlu.runner`` (:mod:`danlu.runner.__main__`) is started by a
backend and learns its attempt from a launch message; it fetches the job's
spec from the service's runner API and reports there (:mod:`~danlu.runner.link`).
:mod:`~danlu.runner.base` owns the order of a run, :mod:`~danlu.runner.execute`
runs papermill on one kernel or torchrun with one kernel per rank
(:mod:`~danlu.runner.rank`), :mod:`~danlu.runner.kernels` starts and primes
kernels, and :mod:`~danlu.runner.tracking` keeps the job's MLflow run.
"""
