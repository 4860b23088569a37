"""What :mod:`danlu.resumable` needs from outside the kernel: the job's other ranks, and the jobs service.

:class:`Ranks` is torch.distributed as a resumable state uses it: which rank this is, one barrier or
broadcast where ranks must agree, a sharded save and load through ``torch.distributed.checkpoint``, and
:class:`Sync`, the one small all-reduce (stop? save? when next?) that makes every rank save and stop
at the same step. It syncs every step at first, then about once a :data:`SYNC_SECONDS`, so a loop of
fast steps pays for one all-reduce a second. Without ``torch.distributed`` initialised (one process,
or ranks that never called ``init_process_group``) each process decides alone and only rank 0 saves.

:class:`ServiceLink` is the kernel's best-effort side of the runner API (never a reason for training
to fail; skipped outside a job): after each committed checkpoint rank 0 sends the ``checkpoint`` event
with its step (once ``/stop`` has shown, by its ``save`` counter, a service that takes that event), and
a background thread asks ``/stop`` at most every 10 s whether the service wants a save now (its
``save`` counter grew) or is stopping the job (``reason``, ``grace``). A 404 or 405 from an older
service is ignored.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from danlu import env


class Ranks:
    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.dist = None
        if self.world > 1 and "torch" in sys.modules:
            import torch.distributed as dist  # deferred: torch is imported already (checked above)

            if dist.is_available() and dist.is_initialized():
                self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()
        self._tag = self.broadcast(f"{os.getpid()}")

    def tag(self) -> str:
        """The same string on every rank of this state (rank 0's pid): names a save's temporary folder."""
        return self._tag

    def broadcast(self, value):
        if self.dist is None:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def want_sharded(self, objects: dict, sharded: bool | None, limit: int) -> bool:
        """Rank 0's choice, for every rank: ``sharded`` if given, else whether the state is over ``limit`` bytes."""
        if sharded is not None:
            return bool(sharded)
        if self.dist is None:
            return False
        return bool(self.broadcast(sum(_bytes(obj.state_dict()) for obj in objects.values()) > limit))

    def syncer(self, clock, seconds: float) -> Sync | None:
        return Sync(self.dist, self.rank, clock, seconds) if self.dist is not None else None

    # torch.distributed.checkpoint ------------------------------------------------------------------
    def _sharded_state(self, objects: dict) -> dict:
        # deferred: torch.distributed.checkpoint takes a second to import; only a sharded state needs it
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        models = [o for o in objects.values() if _is_module(o)]
        out: dict = {}
        for name, obj in objects.items():
            if _is_module(obj):
                out[name] = get_model_state_dict(obj)
            elif _is_optimizer(obj) and len(models) == 1:
                out[name] = get_optimizer_state_dict(models[0], obj)
            else:
                out[name] = obj.state_dict()
        return out

    def save_sharded(self, folder, objects: dict) -> None:
        import torch.distributed.checkpoint as dcp  # deferred: only a sharded state needs it

        dcp.save(self._sharded_state(objects), checkpoint_id=str(folder))

    def load_sharded(self, folder, objects: dict) -> None:
        import torch.distributed.checkpoint as dcp  # deferred: only a sharded state needs it
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = self._sharded_state(objects)
        dcp.load(state, checkpoint_id=str(folder))
        models = [o for o in objects.values() if _is_module(o)]
        for name, obj in objects.items():
            if _is_module(obj):
                set_model_state_dict(obj, state[name])
            elif _is_optimizer(obj) and len(models) == 1:
                set_optimizer_state_dict(models[0], obj, state[name])
            else:
                obj.load_state_dict(state[name])


class Sync:
    """Every rank's stop and save wishes, agreed by an all-reduce (max) at the same steps on every rank.

    Rank 0 also says, in the same all-reduce, after how many steps the next one is: about
    ``seconds`` of steps, so the cost stays one small all-reduce a second however fast a step is.
    """

    def __init__(self, dist, rank: int, clock, seconds: float):
        import torch  # deferred: only ranks of torch.distributed get here, with torch imported

        self.dist, self.rank, self.clock, self.seconds = dist, rank, clock, seconds
        device: Any = "cpu"
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        self.tensor = torch.zeros(3, dtype=torch.int64, device=device)
        self.every, self.count, self.last = 1, 0, clock()
        self.stop = self.save = False

    def step(self, stop: bool, save: bool) -> tuple[bool, bool] | None:
        """(stop, save) agreed by every rank, at a sync step; None between them (the wishes wait)."""
        self.stop, self.save = self.stop or stop, self.save or save
        self.count += 1
        if self.count < self.every:
            return None
        self.count = 0
        now = self.clock()
        elapsed, self.last = now - self.last, now
        upcoming = 0
        if self.rank == 0:
            upcoming = min(10_000, max(1, int(self.every * self.seconds / elapsed) if elapsed > 0 else self.every * 2))
        self.tensor[0], self.tensor[1], self.tensor[2] = int(self.stop), int(self.save), upcoming
        self.dist.all_reduce(self.tensor, op=self.dist.ReduceOp.MAX)
        agreed = [int(x) for x in self.tensor.tolist()]
        self.every = max(1, agreed[2])
        self.stop = self.save = False
        return bool(agreed[0]), bool(agreed[1])


class ServiceLink:
    """Rank 0's best-effort calls to the runner API (skipped outside a job)."""

    def __init__(self, timeout: float = 5.0, poll_seconds: float = 10.0):
        api, token, job, attempt = env.RUNNER_API.get(), env.JOB_TOKEN.get(), env.JOB_ID.get(), env.ATTEMPT.get()
        self.enabled = bool(api and token and job and attempt)
        self.base = f"{(api or '').rstrip('/')}/runner/jobs/{job}/attempts/{attempt}"
        self.token, self.timeout = token, timeout
        self.poll_seconds = poll_seconds
        self.grace: float | None = None
        self.stopping = False
        self.reason: str | None = None
        self._seen: int | None = None
        self._requested = False
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._session: Any = None  # a requests.Session, made at the first call
        self._complained = False
        # a service whose /stop says "save" takes the checkpoint event; an older one would refuse the
        # report as invalid (and fail the attempt), so nothing is sent until /stop has said it
        self.knows_checkpoints = False

    # the poll ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.enabled:
            return
        self._running.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="danlu-resumable", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        self._running.clear()

    def _loop(self) -> None:
        while True:
            self._running.wait()
            self.poll()
            threading.Event().wait(self.poll_seconds)

    def poll(self) -> dict | None:
        """Ask ``/stop``; note a stop, its grace, and a save request (the ``save`` counter grew)."""
        data = self._call("GET", "/stop")
        if not isinstance(data, dict):
            return None
        grace = data.get("grace")
        if isinstance(grace, (int, float)) and not isinstance(grace, bool) and grace > 0:
            self.grace = float(grace)
        if data.get("reason"):
            self.reason, self.stopping = str(data["reason"])[:200], True
        count = data.get("save")
        if isinstance(count, int) and not isinstance(count, bool):
            self.knows_checkpoints = True
            if self._seen is not None and count > self._seen:
                self._requested = True
            self._seen = count if self._seen is None else max(self._seen, count)
        return data

    def take_save_request(self) -> bool:
        if self._requested:
            self._requested = False
            return True
        return False

    def stop_reason(self) -> tuple[str | None, float | None]:
        """Why the job is stopping, and its grace, asked now (a SIGTERM arrived)."""
        if self.enabled and not self.reason:
            self.poll()
        return self.reason, self.grace

    # the report ----------------------------------------------------------------------------------------
    def checkpoint(self, step: int) -> None:
        """Tell the service a checkpoint of ``step`` is committed (in the background)."""
        if self.enabled and self.knows_checkpoints:
            body = {"event": "checkpoint", "step": int(step)}
            threading.Thread(target=self._call, args=("POST", "/events", body), daemon=True).start()

    def _call(self, method: str, path: str, body: dict | None = None):
        try:
            import requests  # deferred: ~0.1 s; only a job's rank 0 talks to the service

            if self._session is None:
                self._session = requests.Session()
                self._session.headers["Authorization"] = f"Bearer {self.token}"
            response = self._session.request(method, self.base + path, json=body, timeout=self.timeout)
            if response.status_code in (404, 405):  # an older service: it does not know this
                return None
            response.raise_for_status()
            return response.json()
        except Exception as e:  # noqa: BLE001 - best effort: the training goes on without it
            if not self._complained:
                self._complained = True
                print(f"danlu: the jobs service did not answer about checkpoints ({str(e)[:200]})", file=sys.stderr)
            return None


def _bytes(state) -> int:
    """The bytes of the tensors in a state dict (nested dicts and lists)."""
    if hasattr(state, "element_size") and hasattr(state, "numel"):
        return state.element_size() * state.numel()
    if isinstance(state, dict):
        return sum(_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes(v) for v in state)
    return 0


def _is_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_optimizer(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)
