"""``python -m danlu.runner [--warm KERNEL]``: one attempt of a job.

The runner waits for its launch message on stdin (see
:mod:`danlu.runner.link`); with ``--warm KERNEL`` it first imports everything,
starts a kernel of that profile and prints ``ready``. End-of-file instead of
a launch message means the service went away: it exits with its kernel. Once
launched it works in the job's folder, sends its output to ``job.log``,
fetches the job's spec from the service, and runs the attempt
(:mod:`danlu.runner.base`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from danlu.lean import skip_unused_imports

skip_unused_imports()  # before anything imports jsonschema (papermill's nbformat does)

from danlu import env
from danlu.errors import DanluError
from danlu.jobdir import JobDir, write_json_atomic
from danlu.proctree import end_descendants, set_child_subreaper
from danlu.runner.execute import runner_for
from danlu.runner.kernels import start_kernel, stop_kernel
from danlu.runner.link import ServiceLink, launch_from_env, read_launch
from danlu.runner.tracking import mlflow_environ


def _redirect_output(path: Path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # something else sits where the log goes (the job's own doing): start a new log
        path.unlink(missing_ok=True)
        fd = os.open(path, flags, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _warm_up(kernel_name: str):
    """Import what a job needs and start a kernel, then say ``ready``; None if the kernel did not start."""
    # Imported here, while a warm runner waits for its launch, so that a job does not wait for them; a cold
    # runner imports each where it is first needed.
    import mlflow  # deferred: mlflow takes ~2 s to import; a warm runner takes that while it waits  # noqa: F401
    import papermill  # deferred: papermill takes ~2 s to import; as mlflow  # noqa: F401

    from danlu.tensorboard import forwarder  # deferred: numpy comes with it (~0.1 s); as mlflow  # noqa: F401

    try:
        km = start_kernel(kernel_name, cwd=os.getcwd())
    except Exception as e:  # noqa: BLE001
        print(f"failed {e}", flush=True)
        return None
    print("ready", flush=True)
    return km


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m danlu.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", metavar="KERNEL", help="start a kernel first, then wait for a launch message")
    parser.add_argument(
        "--kubernetes",
        action="store_true",
        help="in a job pod: the launch comes from the environment, the log goes to the pod's log",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    for noisy in ("urllib3", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    set_child_subreaper()
    km = None
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit(0)))
    try:
        if args.warm:
            km = _warm_up(args.warm)
            if km is None:
                return 1
        launch = launch_from_env() if args.kubernetes else read_launch()
    except (SystemExit, ValueError, KeyError, TypeError) as e:
        if not isinstance(e, SystemExit):
            print(f"danlu runner: bad launch message: {e}", file=sys.stderr, flush=True)
        launch = None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if launch is None:
        if km is not None:
            stop_kernel(km, now=True)
        return 0
    os.environ[env.JOB_ID] = launch.job_id
    # in a pod, the TrainJob may keep checkpoints in the owner's home claim, which outlives the pod
    kept = env.CHECKPOINT_DIR.get() if args.kubernetes else None
    jd = JobDir(Path(launch.job_dir), Path(kept) if kept else None)
    jd.path.mkdir(parents=True, exist_ok=True)
    os.chdir(jd.path)
    if not args.kubernetes:  # in a pod, stdout is the pod's log
        _redirect_output(jd.log_file)
    link = ServiceLink(launch)
    try:
        spec = link.spec()
    except DanluError as e:
        print(f"danlu: could not fetch the job's spec from the service: {e}", file=sys.stderr, flush=True)
        if km is not None:
            stop_kernel(km, now=True)
        return 3
    if args.kubernetes and os.environ.get("HOME"):  # the owner's home is mounted where this pod has it
        spec["cwd"] = str(Path(os.environ["HOME"]) / spec.get("cwd_relative", "."))
        spec["env"] = {**spec.get("env", {}), "HOME": os.environ["HOME"]}
        spec["devices"] = list(range(int(spec.get("gpus") or 0)))  # a pod sees only its own GPUs, from 0
        spec["kernel_name"] = "python3"  # the image is the profile's environment: its own Python kernel
    mlflow_environ(spec)
    write_json_atomic(jd.input_notebook, spec["notebook"])
    runner = runner_for(spec)(link, spec, jd, km=km)
    runner.upload_outputs = args.kubernetes
    return runner.run()


def exit_now(code: int) -> None:
    """End the runner at once, without the interpreter's teardown.

    By then the attempt is over: its ``finished`` report is sent, its kernel stopped, its MLflow run
    closed and its files written. What Python would still do at exit -- MLflow's and papermill's
    atexit work, joining idle threads, freeing every module -- takes a second or more, and the service
    calls the job finished only once this process has ended (its GPUs are free when its processes are
    gone), so that second is every job's. Output is flushed first: the job's log is stdout and stderr.
    Whatever the job left running (detached with ``setsid`` or a double fork, it re-parented to this
    subreaper) ends first: a job's processes end with its attempt.
    """
    left = end_descendants()
    if left:
        print(f"danlu: ended {left} process(es) the job left running", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
