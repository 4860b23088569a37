"""An HTTP-level fake Kubernetes API server with small Kueue, Trainer and kubelet simulators, for tests.

See :class:`FakeCluster` (``server.py``); ``store.py`` holds the objects, ``kueue.py`` admits workloads,
``trainer.py`` turns admitted TrainJobs into pods and ``kubelet.py`` runs pods as local processes.
"""

from .server import FakeCluster

__all__ = ["FakeCluster"]
