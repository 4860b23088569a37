"""Jobs as Kueue-admitted Kubeflow Trainer TrainJobs: the Kubernetes backend.

Each attempt is one TrainJob (:mod:`danlu.hub.k8s.jobs`) plus a Secret with
its job token (and for more nodes than one, the NetworkPolicy that lets its
pods meet: :mod:`danlu.hub.k8s.policies`), created suspended with its team's LocalQueue and priority
class as labels. Kueue admits it, or says why not; :meth:`admission` reports
that answer (and the position from Kueue's visibility API where it is
installed) and the service shows it in the job's ``reason`` and
``queue_position``. Once it runs, the runner in each pod reports to the
service through the runner API as a local runner does; nothing is shared
through a folder. ``--timeout`` is the TrainJob's ``activeDeadlineSeconds``.

An attempt's pods, its rank 0, its kept logs (the end of rank 0's, bounded by
age and total size) and what Kueue's eviction means for it (only ``Preempted``
is a preemption) are :mod:`~danlu.hub.backends.jobpods`. Cancel deletes the
pods first, with the grace period (the ranks checkpoint), then the TrainJob.
The service finds its attempts again after a restart by name and label
(``danlu.io/job-id``); the executed notebooks are in the MLflow run.

Only the API errors understood here are handled: 404 on delete and read
(gone), 409 on create (the same attempt created by an earlier try), 400 on
a pod's log (its container has not started);
429/5xx and connection errors are retried with backoff; anything else is
raised with a message that names the object.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from traitlets import Float, Integer, Unicode, default

from danlu.hub.backends import jobpods
from danlu.hub.backends.base import Admission, Backend, Launch, Outcome
from danlu.hub.k8s import apiclient, jobs, names, policies

TRANSIENT = {429, 500, 502, 503, 504}
RETRIES = (0.5, 1.0, 2.0, 4.0)


class KubernetesError(RuntimeError):
    """A Kubernetes API answer the backend does not handle, named with its object."""


def _conditions(obj: dict | None) -> dict:
    return {c.get("type"): c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if isinstance(c, dict)}


def _true(conditions: dict, kind: str) -> dict | None:
    c = conditions.get(kind)
    return c if c is not None and c.get("status") == "True" else None


class KubernetesBackend(Backend):
    """TrainJobs admitted by Kueue (see the module's docs)."""

    name = "kubernetes"
    queues = True
    runs_in_images = True

    namespace = Unicode(help="The namespace of jobs and LocalQueues. Default: danlu.yaml's kubernetes.namespace.").tag(
        config=True
    )
    kubeconfig = Unicode("", help="A kubeconfig file; empty: the in-cluster service account, else ~/.kube/config.").tag(
        config=True
    )
    runtime = Unicode(help="The ClusterTrainingRuntime jobs run on. Default: kubernetes.runtime.").tag(config=True)
    home_claim = Unicode(
        names.HOME_CLAIM_TEMPLATE,
        help="The PersistentVolumeClaim of a user's home: KubeSpawner's pvc_name_template, expanded "
        "as KubeSpawner does (safe slugs), so jobs mount the notebook's claim; empty: jobs mount none.",
    ).tag(config=True)
    poll_interval = Float(2.0, help="Seconds between looks at the cluster.").tag(config=True)
    log_limit = Integer(8 * 2**20, help="The most of a log read, or of its end kept (bytes).").tag(config=True)
    logs_dir = Unicode(
        help="Where the service keeps the logs of ended attempts. Default: job-logs in the state folder."
    ).tag(config=True)
    logs_max_bytes = Integer(
        256 * 2**20,
        help="The most all kept logs take together (bytes; the oldest go first): the hub's volume is 1 GiB.",
    ).tag(config=True)
    logs_max_age_days = Float(30.0, help="Kept logs older than this go (days; 0: no age limit).").tag(config=True)

    @default("namespace")
    def _namespace(self):
        return self.settings.kubernetes.namespace if self.settings is not None else "danlu"

    @default("runtime")
    def _runtime(self):
        return self.settings.kubernetes.runtime if self.settings is not None else names.RUNTIME

    @default("logs_dir")
    def _logs_dir(self):
        return str(self.settings.state_dir / "job-logs") if self.settings is not None else ""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._client = None
        self._cache: dict[str, tuple[float, object]] = {}
        self._visibility = True
        self._not_ready: dict[str, str] = {}  # attempt (TrainJob) name -> what its pods last waited for

    # the API client ------------------------------------------------------------------------
    async def _api(self):
        if self._client is None:
            self._client = await apiclient.load(self.kubeconfig)
        return self._client

    async def _call(
        self,
        what: str,
        method: str,
        *args,
        missing_ok: bool = False,
        conflict_ok: bool = False,
        not_yet_ok: bool = False,
        **kwargs,
    ):
        """One API call with the errors this backend understands handled (see the module's docs)."""
        import aiohttp  # deferred: kubernetes_asyncio and aiohttp, as in _api
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        api_client = await self._api()
        if method == "GET":  # a path no generated API has (Kueue's visibility API)

            def call():
                return api_client.call_api(
                    args[0],
                    "GET",
                    response_types_map={200: "object"},
                    auth_settings=["BearerToken"],
                    _return_http_data_only=True,
                )
        else:
            api_name, _, verb = method.partition(".")
            bound = getattr(getattr(client, api_name)(api_client), verb)

            def call():
                return bound(*args, **kwargs)

        for delay in (*RETRIES, None):
            try:
                return await call()
            except ApiException as e:
                if (e.status == 404 and missing_ok) or (e.status == 400 and not_yet_ok):
                    return None
                if e.status == 409 and conflict_ok:
                    return "exists"
                if e.status in TRANSIENT and delay is not None:
                    self.log.warning("%s: %s %s; retrying in %g s", what, e.status, e.reason, delay)
                    await asyncio.sleep(delay)
                    continue
                raise KubernetesError(
                    f"{what}: the Kubernetes API answered {e.status} {e.reason}: {_message(e.body)}"
                ) from None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if delay is None:
                    raise KubernetesError(f"{what}: the Kubernetes API is unreachable ({e})") from None
                await asyncio.sleep(delay)

    async def _cached(self, key: str, fetch):
        """Lists shared by every attempt's watcher for one poll interval: O(1) API calls per interval."""
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.poll_interval / 2:
            return hit[1]
        value = await fetch()
        self._cache[key] = (time.monotonic(), value)
        return value

    async def _trainjobs(self) -> dict:
        async def fetch():
            out = await self._call(
                f"listing TrainJobs in {self.namespace}",
                "CustomObjectsApi.list_namespaced_custom_object",
                jobs.GROUP,
                jobs.VERSION,
                self.namespace,
                jobs.PLURAL,
                label_selector=f"{names.MANAGED_BY}={names.MANAGER},{names.COMPONENT}={names.JOB}",
            )
            return {o["metadata"]["name"]: o for o in out.get("items", [])}

        return await self._cached("trainjobs", fetch)

    async def _workloads(self) -> dict:
        async def fetch():
            out = await self._call(
                f"listing Kueue workloads in {self.namespace}",
                "CustomObjectsApi.list_namespaced_custom_object",
                "kueue.x-k8s.io",
                "v1beta2",
                self.namespace,
                "workloads",
            )
            by_owner = {}
            for w in out.get("items", []):
                for ref in w.get("metadata", {}).get("ownerReferences") or []:
                    if ref.get("kind") == "TrainJob":
                        by_owner[ref.get("uid")] = w
            return by_owner

        return await self._cached("workloads", fetch)

    async def _workload_of(self, state: dict) -> dict | None:
        trainjob = (await self._trainjobs()).get(state.get("name", ""))
        if trainjob is None:
            return None
        return (await self._workloads()).get(trainjob["metadata"].get("uid"))

    # the contract ---------------------------------------------------------------------------
    async def start(self, launch: Launch, record) -> dict:
        name = names.trainjob_name(launch.job_id, launch.attempt)
        state = {"name": name, "namespace": self.namespace}
        await record(state)
        manifest = self._manifest(launch)
        created = await self._call(
            f"creating TrainJob {self.namespace}/{name}",
            "CustomObjectsApi.create_namespaced_custom_object",
            jobs.GROUP,
            jobs.VERSION,
            self.namespace,
            jobs.PLURAL,
            manifest,
            conflict_ok=True,
        )
        if created == "exists":  # an earlier try created it: it must be this attempt's
            created = await self._call(
                f"reading TrainJob {self.namespace}/{name}",
                "CustomObjectsApi.get_namespaced_custom_object",
                jobs.GROUP,
                jobs.VERSION,
                self.namespace,
                jobs.PLURAL,
                name,
            )
            if (created.get("metadata", {}).get("labels") or {}).get(names.JOB_ID) != launch.job_id:
                raise KubernetesError(f"TrainJob {self.namespace}/{name} exists and is not job {launch.job_id}'s")
        uid = created["metadata"].get("uid")
        secret = jobs.secret(
            job_id=launch.job_id,
            attempt=launch.attempt,
            owner=launch.owner,
            queue=launch.queue,
            namespace=self.namespace,
            token=launch.token,
            owner_uid=uid,
        )
        done = await self._call(
            f"creating Secret {self.namespace}/{secret['metadata']['name']}",
            "CoreV1Api.create_namespaced_secret",
            self.namespace,
            secret,
            conflict_ok=True,
        )
        if done == "exists":
            await self._call(
                f"replacing Secret {self.namespace}/{secret['metadata']['name']}",
                "CoreV1Api.replace_namespaced_secret",
                secret["metadata"]["name"],
                self.namespace,
                secret,
            )
        if launch.nnodes > 1:  # its pods meet each other; the rendered danlu-jobs policy lets them reach no pod
            peers = policies.make_peer_policy(name, self.namespace, secret["metadata"]["labels"], uid)
            await self._call(
                f"creating NetworkPolicy {self.namespace}/{peers['metadata']['name']}",
                "NetworkingV1Api.create_namespaced_network_policy",
                self.namespace,
                peers,
                conflict_ok=True,
            )
        self._cache.clear()
        return {**state, "uid": uid}

    def _manifest(self, launch: Launch) -> dict:
        profile = self.profiles.get(launch.profile) if self.profiles is not None else None
        image = (profile.environment.get("image") if profile is not None else None) or ""
        if not image:
            raise KubernetesError(
                f"profile '{launch.profile}' has no image (environment.image in profiles.yaml), "
                "so it cannot run on Kubernetes"
            )
        flavor = {}
        for group in (self.settings.gpus.declared or []) if self.settings is not None else []:
            if group.get("flavor") == launch.gpu_type:
                flavor = group
        return jobs.trainjob(
            job_id=launch.job_id,
            attempt=launch.attempt,
            owner=launch.owner,
            queue=launch.queue,
            priority_class=launch.priority_class,
            namespace=self.namespace,
            image=image,
            nproc=launch.nproc,
            api_url=launch.api_url,
            nnodes=launch.nnodes,
            gpus=launch.gpus // launch.nnodes,
            cpu=launch.cpu / launch.nnodes,
            memory=launch.memory / launch.nnodes,
            timeout_seconds=launch.timeout_seconds,
            runtime=self.runtime,
            home_claim=names.home_claim(launch.owner, self.home_claim, self.namespace) if self.home_claim else None,
            gpu_resource=flavor.get("resource", "nvidia.com/gpu"),
            node_labels=flavor.get("node_labels"),
            tolerations=flavor.get("tolerations"),
            allow_outbound=self.settings.privacy.allow_outbound if self.settings is not None else False,
        )

    async def admission(self, job_id: str, state: dict) -> Admission:
        workload = await self._workload_of(state)
        if workload is None:
            return Admission(False, "waiting for Kueue to take it (no workload yet)")
        conditions = _conditions(workload)
        if _true(conditions, "Admitted"):
            return Admission(True)
        pending = conditions.get("QuotaReserved") or {}
        reason = pending.get("message") or "waiting for Kueue to admit it"
        if _true(conditions, "Evicted"):
            reason = f"evicted by Kueue ({conditions['Evicted'].get('message', '')}); waiting again"
        return Admission(False, f"Kueue: {reason}", await self._position(workload))

    async def _position(self, workload: dict) -> int | None:
        if not self._visibility:
            return None
        queue = (workload.get("spec") or {}).get("queueName", "")
        try:
            summary = await self._cached(
                f"pending:{queue}",
                lambda: self._call(
                    f"reading Kueue's pending workloads of {self.namespace}/{queue}",
                    "GET",
                    f"/apis/visibility.kueue.x-k8s.io/v1beta1/namespaces/{self.namespace}/localqueues/{queue}"
                    "/pendingworkloads",
                    missing_ok=True,
                ),
            )
        except KubernetesError as e:
            self.log.info("Kueue's visibility API is not available (%s): no queue positions", e)
            summary = None
        if summary is None:
            self._visibility = False
            return None
        for item in summary.get("items") or []:
            if item.get("metadata", {}).get("name") == workload["metadata"]["name"]:
                position = item.get("positionInLocalQueue")
                return int(position) + 1 if isinstance(position, int) else None
        return None

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        trainjob = (await self._trainjobs()).get(state.get("name", ""))
        if trainjob is None:
            return Outcome(
                "failed",
                f"its TrainJob {self.namespace}/{state.get('name')} is gone (deleted outside Danlu)",
                infrastructure=True,
            )
        conditions = _conditions(trainjob)
        if _true(conditions, "Complete"):
            return Outcome("succeeded")
        failed = _true(conditions, "Failed")
        if failed:
            message = failed.get("message") or failed.get("reason") or "its TrainJob failed"
            if failed.get("reason") == "DeadlineExceeded":
                return Outcome("timed_out", message, authoritative=True)
            return Outcome("failed", message, infrastructure=True)
        workload = (await self._workloads()).get(trainjob["metadata"].get("uid"))
        conditions = _conditions(workload)
        evicted, name = _true(conditions, "Evicted"), state["name"]
        if evicted:  # only a preemption is one; a pods-ready timeout names what the pods waited for
            why = evicted.get("reason") == "PodsReadyTimeout" and jobpods.waiting_for(await self._pods(state))
            timeout = self.settings.kubernetes.pods_ready_timeout if self.settings is not None else 0
            return jobpods.eviction_outcome(evicted, why or self._not_ready.get(name, ""), timeout)
        if _true(conditions, "Admitted") and not _true(conditions, "PodsReady"):
            self._not_ready[name] = jobpods.waiting_for(await self._pods(state)) or self._not_ready.get(name, "")
        return None

    async def wait(self, job_id: str, state: dict) -> None:
        while await self.poll(job_id, state) is None:
            await asyncio.sleep(self.poll_interval)

    async def _pods(self, state: dict) -> list[dict]:
        """The attempt's pods: those JobSet made for its TrainJob (labelled with the JobSet's name, which is
        the TrainJob's), sorted by replicated job, job index and completion index: rank 0 first."""
        out = await self._call(
            f"listing the pods of TrainJob {self.namespace}/{state.get('name')}",
            "CoreV1Api.list_namespaced_pod",
            self.namespace,
            label_selector=f"{jobpods.JOBSET_NAME}={state.get('name')}",
        )
        pods = [p.to_dict() if hasattr(p, "to_dict") else p for p in out.items]
        return sorted(pods, key=jobpods.rank_order)

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        if not state.get("name"):
            return
        for pod in await self._pods(state):  # its ranks get their grace period to checkpoint
            name = pod["metadata"]["name"]
            await self._call(
                f"deleting pod {self.namespace}/{name}",
                "CoreV1Api.delete_namespaced_pod",
                name,
                self.namespace,
                grace_period_seconds=int(grace),
                missing_ok=True,
            )
        await self._delete(state, grace)

    async def _delete(self, state: dict, grace: float = 0) -> None:
        name = state["name"]
        await self._call(
            f"deleting TrainJob {self.namespace}/{name}",
            "CustomObjectsApi.delete_namespaced_custom_object",
            jobs.GROUP,
            jobs.VERSION,
            self.namespace,
            jobs.PLURAL,
            name,
            propagation_policy="Foreground",
            missing_ok=True,
        )
        self._cache.clear()

    async def draining(self, job_id: str, state: dict) -> bool:
        """An evicted TrainJob's pods are deleted with their grace period: while one is left, it may be saving."""
        if not state.get("name"):
            return False
        try:
            return bool(await self._pods(state))
        except KubernetesError:
            return False

    async def cleanup(self, job_id: str, state: dict) -> None:
        """Keep the end of rank 0's log, then delete the attempt's TrainJob (its pods and Secret go with it)."""
        self._not_ready.pop(state.get("name", ""), None)
        if not state.get("name"):
            return
        try:
            text, size = await self._pod_log(state, self.log_limit, tail=True)
            if text:
                kept = (self._kept_log(job_id, state), text, size)
                limits = (self.logs_max_bytes, self.logs_max_age_days * 86400)
                await asyncio.to_thread(jobpods.keep_log, Path(self.logs_dir or "."), *kept, *limits)
        except KubernetesError as e:
            self.log.warning("job %s: its log could not be kept: %s", job_id, e)
        except OSError as e:
            self.log.warning("job %s: its log could not be kept in %s: %s", job_id, self.logs_dir, e)
        await self._delete(state)

    def _kept_log(self, job_id: str, state: dict) -> Path:
        return Path(self.logs_dir or ".") / job_id / f"{state.get('name', 'attempt')}.log"

    async def _pod_log(self, state: dict, limit: int, tail: bool = False) -> tuple[bytes, int]:
        """Rank 0's log: its first ``limit`` bytes, or with ``tail`` its last ``limit`` bytes; and the size
        of what the API returned (the kubelet serves only the current log file of the container)."""
        pods = await self._pods(state)
        if not pods:
            return b"", 0
        name = pods[0]["metadata"]["name"]
        bounds: dict[str, Any] = {"tail_lines": jobpods.LOG_LINES} if tail else {"limit_bytes": limit}
        text = await self._call(
            f"reading the log of pod {self.namespace}/{name}",
            "CoreV1Api.read_namespaced_pod_log",
            name,
            self.namespace,
            container=names.TRAINER_CONTAINER,
            missing_ok=True,
            not_yet_ok=True,
            **bounds,
        )  # 400: its container has not started yet
        data = (text or "").encode() if isinstance(text, str) else (text or b"")
        return (data[-limit:] if tail else data[:limit]), len(data)

    async def read_log(self, job_id: str, state: dict, offset: int, limit: int) -> tuple[bytes, int]:
        kept = self._kept_log(job_id, state)
        if state.get("name") and kept.is_file():
            data = await asyncio.to_thread(kept.read_bytes)
        elif state.get("name"):
            data, _ = await self._pod_log(state, min(self.log_limit, offset + limit))
        else:
            return b"", 0
        return data[offset : offset + limit], len(data)

    async def read_output(self, job_id: str, state: dict, rank: int, offset: int, limit: int):
        return None  # the executed notebooks are artifacts of the job's MLflow run (notebooks/)

    def user_home(self, owner: str) -> str | None:
        return names.HOME

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _message(body) -> str:

    try:
        return str(json.loads(body).get("message", ""))[:300]
    except (TypeError, ValueError, AttributeError):
        return str(body or "")[:300]
