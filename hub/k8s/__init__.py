"""Danlu on Kubernetes: names, pure manifest builders, the notebook spawner and ``danlu render k8s``.

Nothing in this package talks to a cluster except the spawner (through KubeSpawner) and the
Kubernetes job backend (:mod:`danlu.hub.backends.kubernetes`). Everything else builds dicts.
"""
