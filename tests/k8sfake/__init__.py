"""An HTTP-level fake Kubernetes API server with small Kueue, Trainer and kubelet simulators, for tests.

See :class:`FakeCluster` (``server.py``) and README.md (what it models, what it does not); ``store.py``
holds the objects, ``validation.py`` and ``rbac.py`` refuse what the API server refuses, ``kueue.py``
admits workloads, ``trainer.py`` and ``jobset.py`` turn admitted TrainJobs into pods as Trainer, JobSet
and the Job controller do, and ``kubelet.py`` runs pods as local processes.
"""

from .server import FakeCluster

__all__ = ["FakeCluster"]
