"""Every ``DANLU_*`` environment variable, named once with its meaning.

Code never spells a variable's name as a string: it imports it from here
(``os.environ[env.JOB_ID]``). Each name is a :class:`Var`, a ``str`` that also
carries what the variable means, so this module is the reference the docs
point to. ``tests/test_vocabulary.py`` fails when a ``"DANLU_..."`` string
appears anywhere else in Python, or when a shell or TypeScript file uses a
name that is not defined here.

Who sets what:

- ``danlu up`` sets the workbench's own variables for JupyterHub and its
  services (``CONFIG`` .. ``GATEWAY_PORT``, ``INSTANCE``);
- the spawner sets the user-server variables (``URL``, ``PUBLIC_URL``,
  ``PROFILE``);
- the job runner sets the in-job variables in every kernel of a job
  (``JOB_ID``, ``JOB_DIR``, ``CHECKPOINT_DIR``, and ``RUNNER_API``,
  ``ATTEMPT``, ``JOB_TOKEN`` for ``danlu.dataset``);
- users set the client variables (``URL``, ``TOKEN``) outside a server.

Besides the names, :func:`private_environment` is the one place that says what every process
of the workbench carries so that none phones home (``privacy.allow_outbound``).
"""

from __future__ import annotations

import os


class Var(str):
    """An environment variable's name (a ``str``) with its meaning."""

    meaning: str

    def __new__(cls, name: str, meaning: str) -> "Var":
        var = super().__new__(cls, name)
        var.meaning = meaning
        return var

    def __getnewargs__(self):  # copies (JupyterHub deep-copies its services' environments) keep the meaning
        return str(self), self.meaning

    def get(self, default: str | None = None, environ=None) -> str | None:
        """The value in ``environ`` (default ``os.environ``); empty counts as unset."""
        value = (os.environ if environ is None else environ).get(self)
        return value if value else default


# the workbench (set by danlu up) ------------------------------------------------------------
CONFIG = Var("DANLU_CONFIG", "The danlu.yaml every process reads (absolute path; empty: built-in defaults).")
STATE_DIR = Var("DANLU_STATE_DIR", "The state folder: databases, job folders, MLflow data, tokens, logs.")
BASE_DIR = Var("DANLU_BASE_DIR", "The folder danlu up ran in; relative paths in danlu.yaml start there.")
PROFILES_FILE = Var(
    "DANLU_PROFILES_FILE",
    "The governed profiles file, over danlu.yaml's profiles_file (on Kubernetes: the profiles.yaml beside danlu.yaml).",
)
IP = Var("DANLU_IP", "The address the public proxy listens on.")
PORT = Var("DANLU_PORT", "The port of the public proxy.")
ADMIN_TOKEN = Var(
    "DANLU_ADMIN_TOKEN", "The admin API token (for automation); generated into <state>/admin-token when unset."
)
MLFLOW_URL = Var("DANLU_MLFLOW_URL", "Loopback URL of the MLflow tracking server (behind the gateway for users).")
MLFLOW_AUTH_SECRET = Var(
    "DANLU_MLFLOW_AUTH_SECRET",
    "The secret MLflow credentials are derived from; only the MLflow server, its gateway and the jobs service see it.",
)
AUDIT_KEY = Var(
    "DANLU_AUDIT_KEY",
    "The key of the audit log's HMAC chain (at least 32 characters; on Kubernetes from the danlu-secrets Secret); "
    "unset: <state>/audit.key, made on first start. Only the jobs service and danlu up read it.",
)
HUB_PORT = Var("DANLU_HUB_PORT", "Loopback port of JupyterHub's own API.")
PROXY_API_PORT = Var("DANLU_PROXY_API_PORT", "Loopback port of configurable-http-proxy's REST API.")
SERVICE_PORT = Var("DANLU_SERVICE_PORT", "Loopback port of the jobs service.")
GATEWAY_PORT = Var("DANLU_GATEWAY_PORT", "Loopback port of the MLflow gateway.")
INSTANCE = Var("DANLU_INSTANCE", "A marker every process of one danlu up carries, so stopping it leaves none behind.")

# a user's server and its clients -----------------------------------------------------------
URL = Var("DANLU_URL", "Where clients reach the workbench (the hub's base URL); set in every Danlu server.")
PUBLIC_URL = Var("DANLU_PUBLIC_URL", "Where browsers reach the workbench (links in job cards).")
TOKEN = Var("DANLU_TOKEN", "A JupyterHub API token for the danlu CLI and %%train outside a server.")
PROFILE = Var("DANLU_PROFILE", "The governed profile a server was started from (the default for %%train).")

TENSORBOARD_TOKEN = Var(
    "DANLU_TENSORBOARD_TOKEN",
    "The token a TensorBoard the lab extension starts requires on every request (its proxy adds it); "
    "in that TensorBoard's environment only.",
)

# inside a job ----------------------------------------------------------------------------
JOB_ID = Var("DANLU_JOB_ID", "The job's id, in every process of the job (the marker that ends them together).")
RUNNER_ID = Var(
    "DANLU_RUNNER_ID",
    "A marker every job runner and its kernels carry from their start, so a runner "
    "that dies takes its kernels and ranks with it.",
)
ATTEMPT = Var(
    "DANLU_ATTEMPT",
    "In a job pod, and every kernel of a job: the attempt it runs (the launch message of a local runner says it).",
)
RUNNER_API = Var(
    "DANLU_RUNNER_API",
    "In a job pod, and every kernel of a job: the service's runner API (.../api/v1) "
    "the runner reports to and danlu.dataset() asks.",
)
JOB_TOKEN = Var(
    "DANLU_JOB_TOKEN",
    "In a job pod (from the attempt's Secret), and every kernel of a job: the attempt's job token (never logged).",
)
JOB_DIR = Var("DANLU_JOB_DIR", "The job's folder: log, output notebooks, TensorBoard events.")
CHECKPOINT_DIR = Var("DANLU_CHECKPOINT_DIR", "Where a job saves checkpoints; kept across its attempts.")

# tests and their tools -----------------------------------------------------------------------
TEST_POSTGRES_URL = Var(
    "DANLU_TEST_POSTGRES_URL", "Tests: a PostgreSQL database the service tests also run against (.ci/run starts one)."
)
TEST_UNIX_PYTHON = Var(
    "DANLU_TEST_UNIX_PYTHON",
    "Tests: a Python with Danlu installed that every account can "
    "run, for the unix-accounts tier (.ci/run builds one in /opt).",
)
TEST_REQUIRE = Var(
    "DANLU_TEST_REQUIRE",
    "Tests: the tiers that must run, comma-separated (unix, postgres, ui): "
    "each fails instead of skipping when it cannot (.ci/run sets all three).",
)
FAKE_NVML = Var(
    "DANLU_FAKE_NVML",
    "Tests: the JSON state of tests/fakenvml, the fake nvidia-ml-py (devices, utilization, lost GPUs).",
)
TEST_CLUSTER_URL = Var(
    "DANLU_TEST_CLUSTER_URL",
    "Tests: the public URL of Danlu deployed on a real cluster (with KUBECONFIG); the cluster tier skips without it.",
)
TEST_CLUSTER_TOKEN = Var("DANLU_TEST_CLUSTER_TOKEN", "Tests: a hub API token of a user in a team there.")
BENCH_POSTGRES_URL = Var(
    "DANLU_BENCH_POSTGRES_URL",
    "Benchmarks: a PostgreSQL database benchmarks/history.py fills (in schemas of its own, dropped afterwards).",
)
UI_CHROMIUM = Var("DANLU_UI_CHROMIUM", "Browser tests: the Chromium binary Playwright drives.")
UI_HUB_URL = Var("DANLU_UI_HUB_URL", "Browser tests: the workbench under test.")
UI_USER = Var("DANLU_UI_USER", "Browser tests: the user who logs in.")
UI_NOTEBOOK = Var("DANLU_UI_NOTEBOOK", "Browser tests: the notebook they open.")
UI_FOLDER = Var("DANLU_UI_FOLDER", "Browser tests: the folder of that notebook.")
UI_ARTIFACTS = Var("DANLU_UI_ARTIFACTS", "Browser tests: where screenshots and traces go.")
UI_DOCS_IMAGES = Var("DANLU_UI_DOCS_IMAGES", "Browser tests: where screenshots for the docs go, if set.")
UI_DATASET = Var("DANLU_UI_DATASET", "Browser tests: the dataset the lineage test registered for the job.")
UI_APPROVER_TOKEN = Var("DANLU_UI_APPROVER_TOKEN", "Browser tests: an admin's API token, to approve the model.")
UI_TOKEN = Var("DANLU_UI_TOKEN", "Browser tests: the test user's API token, to start a sweep through the jobs API.")
UI_SPEC = Var("DANLU_UI_SPEC", "Browser tests: run only this spec file (tests/<name>.spec.ts), e.g. sweeps.")

ALL: tuple[Var, ...] = tuple(v for v in globals().values() if isinstance(v, Var))

# privacy: what every process of the workbench carries ----------------------------------------
#: a site's way out of its network: passed on to every process, so whatever goes out goes through it
PROXY_VARS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)
#: where no proxy is ever asked: the workbench's own processes talk to each other there
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: the libraries' own switches against phoning home: MLflow 3's usage telemetry (its server, its UI's
#: configuration and every client) reads the first two, Hugging Face Hub the last
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def private_environment(allow_outbound: bool = False, environ=None) -> dict[str, str]:
    """The environment every process of the workbench gets (``privacy.allow_outbound`` of danlu.yaml).

    The supervisor, the hub's services, users' servers (and so their kernels and TensorBoards), job
    runners (and so job kernels) and, on Kubernetes, every pod Danlu renders carry it, so no library
    reaches outside on the workbench's behalf unless the admin allows it: with ``allow_outbound`` off,
    :data:`TELEMETRY_OFF`. And the site's proxy variables of ``environ`` (default ``os.environ``), where
    set, with :data:`LOOPBACK` added to ``NO_PROXY``: a site whose only way out is a proxy sees every
    attempt there, and the processes' calls to each other never go to it.
    """
    environ = os.environ if environ is None else environ
    out = {name: environ[name] for name in PROXY_VARS if environ.get(name)}
    if out:
        for name in ("NO_PROXY", "no_proxy"):
            hosts = [h.strip() for h in out.get(name, "").split(",") if h.strip()]
            out[name] = ",".join(hosts + [h for h in LOOPBACK if h not in hosts])
    if not allow_outbound:
        out.update(TELEMETRY_OFF)
    return out
