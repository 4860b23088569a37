"""The fake kubelet: each Pod's first container runs as a local process, its volumes mapped to folders.

It owns the pod lifecycle the API shows: ``Pending`` -> ``Running`` (``startTime``, a running container
status) -> ``Succeeded``/``Failed`` (the exit code), and graceful deletion (``SIGTERM`` to the process
group, ``SIGKILL`` after the grace period, then the object goes). The image is ignored; a leading
``python``/``python3`` becomes ``sys.executable``. ``emptyDir`` volumes are fresh folders per pod;
``persistentVolumeClaim`` volumes are the test's folders in ``cluster.volumes`` (an unknown claim leaves
the pod ``Pending`` with a ``FailedMount`` event). Every mount path found as a prefix in env values,
command, args or ``workingDir`` is rewritten to the local folder. Logs are stdout and stderr together.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from .store import ApiError, Store, not_found, now

KEEP_ENV = re.compile(r"^(PATH|LANG|LC_ALL|PYTHON.*)$")
DEFAULT_GRACE = 30


@dataclass
class Process:
    popen: subprocess.Popen
    log: str
    started: str
    dirs: list[str] = field(default_factory=list)
    kill_at: float | None = None  # set when the pod is being deleted


def kill_group(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _rewrite(value: str, mounts: list[tuple[str, str]]) -> str:
    for mount_path, local in mounts:  # longest first
        value = re.sub(re.escape(mount_path.rstrip("/")) + r"(?=/|$|[:;,\s\"'])", lambda _m, p=local: p, value)
    return value


class Kubelet:
    def __init__(self, store: Store, volumes: dict[str, str], workdir: str):
        self.store, self.volumes, self.workdir = store, volumes, workdir
        self.procs: dict[str, Process] = {}  # pod uid -> its process
        self.logs: dict[tuple[str, str], str] = {}  # (namespace, pod) -> log file (kept after exit)
        self._events: set[tuple[str, str]] = set()
        self.unpullable: set[str] = set()  # images no registry serves: their pods wait in ErrImagePull

    # --- the API's side ---

    def log(self, namespace: str, name: str, query: dict) -> str:
        pod = self.store.find("Pod", namespace, name)
        if pod is None:
            raise not_found("Pod", name)
        container = pod["spec"]["containers"][0]["name"]
        if query.get("container") not in (None, container):
            raise ApiError(400, "BadRequest", f"container {query['container']} is not valid for pod {name}")
        path = self.logs.get((namespace, name))
        if path is None:
            raise ApiError(
                400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        with open(path, "rb") as f:
            data = f.read()
        if query.get("tailLines") is not None:
            lines = data.splitlines(keepends=True)
            tail = int(query["tailLines"])
            data = b"".join(lines[-tail:]) if tail else b""
        if query.get("limitBytes") is not None:
            data = data[: int(query["limitBytes"])]
        return data.decode(errors="replace")

    def delete(self, pod: dict, grace: int | None) -> dict:
        meta = pod["metadata"]
        proc = self.procs.get(meta["uid"])
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE)
        if proc is None or proc.popen.poll() is not None or grace <= 0:
            if proc is not None:
                kill_group(proc.popen.pid)
                proc.popen.wait()
                self._forget(meta["uid"])
            return self.store.remove("Pod", meta["namespace"], meta["name"]) or pod
        if proc.kill_at is None:
            kill_group(proc.popen.pid, signal.SIGTERM)
            proc.kill_at = time.monotonic() + grace

        def mark(p):
            p["metadata"].setdefault("deletionTimestamp", now())
            p["metadata"]["deletionGracePeriodSeconds"] = grace

        return self.store.mutate("Pod", meta["namespace"], meta["name"], mark) or pod

    def kill_all(self) -> None:
        for uid, proc in list(self.procs.items()):
            kill_group(proc.popen.pid)
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        proc = self.procs.pop(uid, None)
        if proc is not None:
            for d in proc.dirs:
                shutil.rmtree(d, ignore_errors=True)

    # --- reconcile ---

    def reconcile(self) -> None:
        for pod in self.store.list("Pod"):
            meta = pod["metadata"]
            proc = self.procs.get(meta["uid"])
            if proc is None:
                if "deletionTimestamp" in meta:
                    self.store.remove("Pod", meta["namespace"], meta["name"])
                elif pod.get("status", {}).get("phase", "Pending") == "Pending":
                    self._start(pod)
                continue
            code = proc.popen.poll()
            if proc.kill_at is not None:
                if code is not None:
                    self._forget(meta["uid"])
                    self.store.remove("Pod", meta["namespace"], meta["name"])
                elif time.monotonic() >= proc.kill_at:
                    kill_group(proc.popen.pid)
                continue
            if code is not None and pod["status"].get("phase") == "Running":
                self._terminated(pod, proc, code)
        live = {p["metadata"]["uid"] for p in self.store.list("Pod")}
        for uid in [u for u in self.procs if u not in live]:
            kill_group(self.procs[uid].popen.pid)
            self._forget(uid)

    def _event(self, pod: dict, reason: str, message: str) -> None:
        key = (pod["metadata"]["uid"], reason)
        if key in self._events:
            return
        self._events.add(key)
        meta = pod["metadata"]
        self.store.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "reason": reason,
                "message": message,
                "type": "Warning",
                "count": 1,
                "firstTimestamp": now(),
                "lastTimestamp": now(),
                "source": {"component": "kubelet"},
            }
        )

    def _mounts(self, pod: dict) -> tuple[list[tuple[str, str]], list[str]] | None:
        """(mountPath, local folder) of the first container, longest path first, and the pod's temp dirs;
        None when a claim is not mapped (the pod waits)."""
        meta, spec = pod["metadata"], pod["spec"]
        local, dirs = {}, []
        for volume in spec.get("volumes") or []:
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in self.volumes:
                    self._event(pod, "FailedMount", f'persistentvolumeclaim "{claim}" not found')
                    self._unschedulable(pod, f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found.')
                    for d in dirs:
                        shutil.rmtree(d, ignore_errors=True)
                    return None
                local[volume["name"]] = str(self.volumes[claim])
            else:  # emptyDir, and anything else, is a fresh folder
                d = tempfile.mkdtemp(prefix=f"{meta['name']}-{volume['name']}-", dir=self.workdir)
                if "secret" in volume:
                    self._write_secret(meta["namespace"], volume["secret"]["secretName"], d)
                dirs.append(d)
                local[volume["name"]] = d
        mounts = []
        for mount in spec["containers"][0].get("volumeMounts") or []:
            folder = local.get(mount["name"])
            if folder is None:
                continue
            if mount.get("subPath"):
                folder = os.path.join(folder, mount["subPath"])
                os.makedirs(folder, exist_ok=True)
            mounts.append((mount["mountPath"], folder))
        return sorted(mounts, key=lambda m: -len(m[0])), dirs

    def _unschedulable(self, pod: dict, message: str) -> None:
        """The scheduler's answer for a pod no node can take (here: one whose claim does not exist)."""
        cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        if cond not in [{k: c.get(k) for k in cond} for c in pod["status"].get("conditions") or []]:

            def update(p):
                p["status"]["conditions"] = [{**cond, "lastTransitionTime": now()}]

            self.store.mutate("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"], update)

    def _write_secret(self, namespace: str, name: str, folder: str) -> None:
        secret = self.store.find("Secret", namespace, name) or {}
        for key, value in (secret.get("data") or {}).items():
            with open(os.path.join(folder, key), "wb") as f:
                f.write(base64.b64decode(value))

    def _env(self, pod: dict, container: dict, mounts) -> dict[str, str] | str:
        env = {k: v for k, v in os.environ.items() if KEEP_ENV.match(k)}
        meta = pod["metadata"]
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = _rewrite(str(var["value"]), mounts)
                continue
            source = var.get("valueFrom") or {}
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.store.find("Secret", meta["namespace"], ref["name"])
                data = (secret or {}).get("data") or {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    return (
                        f'secret "{ref["name"]}" not found'
                        if secret is None
                        else f"couldn't find key {ref['key']} in Secret {meta['namespace']}/{ref['name']}"
                    )
                env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {
                    "metadata.name": meta["name"],
                    "metadata.namespace": meta["namespace"],
                    "metadata.uid": meta["uid"],
                    "status.podIP": "127.0.0.1",
                }.get(path, "")
            else:
                env[var["name"]] = var.get("value", "")
        return env

    def _start(self, pod: dict) -> None:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        if container.get("image") in self.unpullable:
            message = f'rpc error: failed to pull and unpack image "{container["image"]}": not found'
            self._event(pod, "Failed", f'Failed to pull image "{container["image"]}": {message}')
            waiting = {"waiting": {"reason": "ErrImagePull", "message": message}}
            if ((pod["status"].get("containerStatuses") or [{}])[0].get("state")) != waiting:
                self._set_status(pod, "Pending", waiting)
            return
        found = self._mounts(pod)
        if found is None:
            return
        mounts, dirs = found
        env = self._env(pod, container, mounts)
        if isinstance(env, str):
            self._event(pod, "Failed", f"Error: {env}")
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            return
        argv = [_rewrite(str(a), mounts) for a in (container.get("command") or []) + (container.get("args") or [])]
        if argv and os.path.basename(argv[0]) in ("python", "python3"):
            argv[0] = sys.executable
        sandbox = tempfile.mkdtemp(prefix=f"{meta['name']}-", dir=self.workdir)
        dirs.append(sandbox)
        cwd = _rewrite(container["workingDir"], mounts) if container.get("workingDir") else sandbox
        log = os.path.join(self.workdir, f"{meta['namespace']}_{meta['name']}.log")
        try:
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except (OSError, IndexError) as e:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            self.logs[(meta["namespace"], meta["name"])] = log
            return self._set_status(
                pod,
                "Failed",
                {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": str(e),
                        "startedAt": now(),
                        "finishedAt": now(),
                    }
                },
            )
        self.logs[(meta["namespace"], meta["name"])] = log
        self.procs[meta["uid"]] = Process(popen, log, now(), dirs)
        self._set_status(pod, "Running", {"running": {"startedAt": now()}})

    def _terminated(self, pod: dict, proc: Process, code: int) -> None:
        exit_code = code if code >= 0 else 128 - code
        self._set_status(
            pod,
            "Succeeded" if code == 0 else "Failed",
            {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": proc.started,
                    "finishedAt": now(),
                }
            },
        )
        self._forget(pod["metadata"]["uid"])

    def _set_status(self, pod: dict, phase: str, state: dict) -> None:
        container = pod["spec"]["containers"][0]
        running = "running" in state

        def update(p):
            status = p.setdefault("status", {})
            status.update(phase=phase, hostIP="127.0.0.1", podIP="127.0.0.1")
            status.setdefault("startTime", now())
            status["conditions"] = [
                {"type": "Ready", "status": "True" if running else "False", "lastTransitionTime": now()}
            ]
            status["containerStatuses"] = [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": running,
                    "started": running,
                    "restartCount": 0,
                    "state": state,
                }
            ]

        self.store.mutate("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"], update)
