"""Which MLflow routes Danlu's users may call: an allow-list taken from MLflow's own route table.

The one rule, applied twice: by the gateway (:mod:`danlu.hub.mlflow_gateway`) to users' requests,
and by the MLflow server itself (:mod:`danlu.hub.mlflowserver`) to every caller but the jobs
service's own account, so a job holding its owner's MLflow credentials is held to it too.

The MLflow server (3.17) answers some 540 routes. Danlu's users need those of the tracking
UI and of MLflow's clients: experiments, runs, metrics, logged models, artifacts in both
directions, traces (experiment data, under the experiment's permissions), reads of the
model registry, their own permissions, and the UI's page and static files. Everything else
is refused on purpose, each group with the reason a user sees (:data:`REFUSED`): the AI
gateway and its endpoints, secrets and budgets (any user could point an endpoint's
``api_base`` at any URL and have the MLflow server request it), webhooks (the same, by
design), the assistant, MCP servers, prompts and the GenAI jobs, scorers and judges that
call language models, MLflow's user and role management (users are hub identities), writes
to the model registry (Danlu registers models, :mod:`danlu.hub.service.model_registry`),
presigned and multipart URLs (they hand out direct object-store access), and the UI's
telemetry. A route in neither list is unknown (404): a new MLflow adds routes, and
``tests/test_mlflow_gateway.py`` fails until each is put in one list or the other.

Templates are MLflow's paths below its ``--static-prefix``, with ``<id>`` for one path
segment and ``<path>`` for several (MLflow's ``<x>``/``{x}`` and ``<path:x>``/``{x:path}``).
Requests are matched on the percent-decoded path, as MLflow's ASGI server routes them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import unquote

API, AJAX, API3, AJAX3 = "/api/2.0/mlflow/", "/ajax-api/2.0/mlflow/", "/api/3.0/mlflow/", "/ajax-api/3.0/mlflow/"


def _both(methods: str, *names: str, v3: bool = False) -> list[tuple[str, str]]:
    """The REST route and its ``ajax-api`` twin (the UI's) for each name."""
    rest, ajax = (API3, AJAX3) if v3 else (API, AJAX)
    return [(methods, prefix + name) for name in names for prefix in (rest, ajax)]


#: (methods, template) the gateway forwards; every one exists in MLflow's route table (tested)
ALLOWED: list[tuple[str, str]] = [
    # the UI: its page (the only answer the gateway edits: the XSRF script), assets, and what it asks first
    ("GET", "/"),
    ("GET", "/static-files/<path>"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/ajax-api/3.0/mlflow/ui-telemetry"),  # the UI reads whether telemetry is on; the POST is refused
    *_both("GET", "server-info", v3=True),
    ("GET POST", "/graphql"),  # queries and two read-only "mutations" (searches); see GRAPHQL_MUTATIONS
    # tracking: experiments, runs, metrics
    *_both("POST", "experiments/create", "experiments/delete", "experiments/restore", "experiments/update"),
    *_both("POST", "experiments/set-experiment-tag", "experiments/delete-experiment-tag"),
    *_both("GET", "experiments/get", "experiments/get-by-name"),
    *_both("GET POST", "experiments/search"),
    ("POST", AJAX + "experiments/search-datasets"),
    *_both("POST", "runs/create", "runs/delete", "runs/restore", "runs/update", "runs/search"),
    *_both("POST", "runs/log-metric", "runs/log-parameter", "runs/log-batch", "runs/log-model", "runs/log-inputs"),
    *_both("POST", "runs/outputs", "runs/set-tag", "runs/delete-tag"),
    *_both("GET", "runs/get", "metrics/get-history", "metrics/get-history-bulk-interval"),
    ("GET", AJAX + "metrics/get-history-bulk"),
    # logged models (MLflow 3's log_model)
    *_both("POST", "logged-models", "logged-models/search", "logged-models/<id>/params"),
    *_both("GET PATCH DELETE", "logged-models/<id>"),
    *_both("PATCH", "logged-models/<id>/tags"),
    *_both("DELETE", "logged-models/<id>/tags/<id>"),
    *_both("GET", "logged-models/<id>/artifacts/directories"),
    ("GET", AJAX + "logged-models/<id>/artifacts/files"),
    # artifacts, streamed both ways through the artifact proxy
    *_both("GET", "artifacts/list"),
    ("GET", "/api/2.0/mlflow-artifacts/artifacts"),
    ("GET", "/ajax-api/2.0/mlflow-artifacts/artifacts"),
    ("GET PUT DELETE", "/api/2.0/mlflow-artifacts/artifacts/<path>"),
    ("GET PUT DELETE", "/ajax-api/2.0/mlflow-artifacts/artifacts/<path>"),
    ("POST", AJAX + "upload-artifact"),
    ("GET", "/get-artifact"),
    ("GET", "/model-versions/get-artifact"),
    # the model registry: reads only
    *_both("GET", "registered-models/get", "registered-models/search", "registered-models/alias"),
    *_both("GET POST", "registered-models/get-latest-versions"),
    *_both("GET", "model-versions/get", "model-versions/search", "model-versions/get-download-uri"),
    # traces: data in an experiment, under its permissions (clients that trace log them here)
    *_both("GET POST", "traces"),
    *_both("PATCH", "traces/<id>"),
    *_both("GET", "traces/<id>/info"),
    *_both("PATCH DELETE", "traces/<id>/tags"),
    *_both("POST", "traces/delete-traces", "traces/link-to-run"),
    *_both("GET", "unified-traces"),
    ("GET", AJAX + "get-trace-artifact"),
    ("GET", AJAX3 + "get-trace-artifact"),
    *_both("POST", "traces", "traces/batchGetInfos", "traces/delete-traces", "traces/search", v3=True),
    *_both("POST", "traces/metrics", "traces/calculate-filter-correlation", v3=True),
    *_both("GET", "traces/<id>", "traces/batchGet", "traces/get", v3=True),
    *_both("POST", "traces/<id>/assessments", v3=True),
    *_both("GET PATCH DELETE", "traces/<id>/assessments/<id>", v3=True),
    *_both("PATCH DELETE", "traces/<id>/tags", v3=True),
    # who may do what: reads, and the grants an experiment's owner (MANAGE) makes
    *_both("GET", "users/current", "users/get", "users/list"),
    *_both("GET", "users/current/permissions", "users/permissions/get", "users/permissions/list", v3=True),
    *_both("GET", "users/roles/list", v3=True),
    *_both("POST", "users/permissions/grant", "users/permissions/revoke", v3=True),
    *_both("GET", "workspaces", "workspaces/<id>", v3=True),
]

#: refused on purpose: (reason, why, template prefixes); the first group whose prefix starts the path wins
REFUSED: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "ai_gateway",
        "MLflow's AI gateway (endpoints, secrets, model definitions, budgets, guardrails, proxies) makes the "
        "MLflow server call URLs its users choose; Danlu does not offer it",
        (
            "/gateway/",
            API3 + "gateway/",
            AJAX3 + "gateway/",
            AJAX + "gateway-proxy",
            "/api/2.0/endpoints/",
            "/ajax-api/2.0/agents/",
        ),
    ),
    (
        "webhooks",
        "MLflow's webhooks make the MLflow server call URLs its users choose",
        (API + "webhooks", AJAX + "webhooks"),
    ),
    (
        "assistant",
        "MLflow's assistant runs tools and calls language models; Danlu does not offer it",
        (AJAX3 + "assistant/",),
    ),
    ("mcp_servers", "MLflow's MCP server registry is not part of Danlu", (API3 + "mcp-servers", AJAX3 + "mcp-servers")),
    (
        "prompts",
        "MLflow's prompt registry, prompt lab and prompt optimization are not part of Danlu",
        (API3 + "prompt-optimization/", AJAX3 + "prompt-optimization/", AJAX + "runs/create-promptlab-run")
        + tuple(p + "traces/link-prompts" for p in (API, AJAX)),
    ),
    (
        "genai",
        "MLflow's GenAI evaluation (jobs, scorers, judges, issues, review queues, label schemas, evaluation "
        "datasets, demo data) calls language models and runs server-side jobs; Danlu does not offer it",
        tuple(
            p + name
            for p in (API3, AJAX3)
            for name in (
                "jobs/",
                "scorers/",
                "scorer/",
                "genai/",
                "issues",
                "review-queues/",
                "label-schemas/",
                "datasets/",
                "demo/",
            )
        )
        + ("/ajax-api/3.0/jobs/", "/v1/traces", API + "get-online-trace-details", AJAX + "get-online-trace-details"),
    ),
    (
        "users_and_roles",
        "MLflow's users and roles are Danlu's hub identities and groups: manage them in the hub",
        tuple(p + name for p in (API, AJAX) for name in ("users/create", "users/delete", "users/update-"))
        + (API3 + "roles/", AJAX3 + "roles/", "/signup", API3 + "workspaces", AJAX3 + "workspaces"),
    ),
    (
        "registry_writes",
        "registered models are written by Danlu only: register and approve with 'danlu models'",
        tuple(p + name for p in (API, AJAX) for name in ("registered-models/", "model-versions/")),
    ),
    (
        "direct_storage",
        "presigned and multipart URLs give direct access to the artifact store around the gateway; "
        "artifacts are uploaded and downloaded through it",
        tuple(p + name for p in (API, AJAX) for name in ("artifacts/presigned-",))
        + tuple(
            p + name
            for p in ("/api/2.0/", "/ajax-api/2.0/")
            for name in ("mlflow-artifacts/presigned/", "mlflow-artifacts/mpu/")
        ),
    ),
    ("telemetry", "the MLflow UI's telemetry is off in Danlu (nothing leaves the machine)", (AJAX3 + "ui-telemetry",)),
    ("flask_static", "the UI loads its files from /static-files", ("/build/",)),  # Flask's default static route
    # MLflow 3.17 registers search-datasets once more without the slash after 2.0 (a typo; the real one is allowed)
    ("mlflow_typo", "not an MLflow route the UI or clients use", ("/api/2.0mlflow/", "/ajax-api/2.0mlflow/")),
]

#: GraphQL's MutationType fields in MLflow 3.17: searches that change nothing, and an echo (tested)
GRAPHQL_MUTATIONS = frozenset({"mlflow_search_datasets", "mlflow_search_runs", "testMutation"})

#: where a request names an experiment, so :func:`namespace_refusal` checks the name
#: (its body, at most :data:`MAX_NAMING_BODY` bytes, is read whole before it is passed on)
MAX_NAMING_BODY = 2**20
EXPERIMENT_NAMING = frozenset(p + name for p in (API, AJAX) for name in ("experiments/create", "experiments/update"))


def normalize(template: str) -> str:
    """An MLflow route template (Flask's ``<x>``, ``<path:x>``; FastAPI's ``{x}``, ``{x:path}``) in our form."""
    template = re.sub(r"<path:[^>]+>|\{[^}:]+:path\}", "<path>", template)
    return re.sub(r"<[^>]+>(?<!<path>)|\{[^}]+\}", "<id>", template)


def _regex(template: str) -> re.Pattern:
    parts = re.split(r"(<id>|<path>)", template)
    return re.compile("".join({"<id>": "[^/]+", "<path>": ".+"}.get(p, re.escape(p)) for p in parts))


_ALLOWED = [(frozenset(methods.split()), _regex(template), template) for methods, template in ALLOWED]


@dataclass(frozen=True)
class Decision:
    """What the gateway does with a request: forward it (``status`` 0), or answer ``status`` with ``reason``."""

    route: str
    status: int = 0
    reason: str = ""
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.status == 0


def server_route(path: str, prefix: str) -> str:
    """The MLflow route of a path as the MLflow server routes it (ASGI's ``scope["path"]``, decoded once).

    Below ``--static-prefix`` the prefix is taken off; a path outside it is a route as it stands
    (MLflow mounts its artifact router and ``/signup`` at the root as well).
    """
    prefix = prefix.rstrip("/")
    if prefix and (path == prefix or path.startswith(prefix + "/")):
        return path[len(prefix) :] or "/"
    return path


#: MLflow's own error code for each refusal status, so MLflow's clients show the refusal as one of theirs
ERROR_CODES = {400: "BAD_REQUEST", 403: "PERMISSION_DENIED", 404: "ENDPOINT_NOT_FOUND", 413: "INVALID_PARAMETER_VALUE"}


def refusal(status: int, reason: str, message: str, route: str | None = None) -> dict:
    """The JSON body of a refusal, the same from the gateway and from the MLflow server.

    Danlu's ``status``/``reason``/``message``, with MLflow's ``error_code`` beside them: an
    MLflow client raises ``PERMISSION_DENIED: <message>`` rather than an internal error.
    """
    body = {"status": status, "reason": reason, "message": message, "error_code": ERROR_CODES.get(status, "")}
    if route is not None:
        body["route"] = route
    return body


def route_path(path: str, prefix: str) -> str | None:
    """The MLflow route of a request path below the gateway's ``prefix`` (decoded); None outside it."""
    path = unquote(path)
    prefix = prefix.rstrip("/")
    if path == prefix:
        return "/"
    if not path.startswith(prefix + "/"):
        return None
    return path[len(prefix) :]


def decide(method: str, route: str) -> Decision:
    """Forward ``method route`` (a path from :func:`route_path`) or refuse it, saying which route and why."""
    method = "GET" if method == "HEAD" else method
    if re.search(r"(^|/)\.\.?(/|$)|//", route):
        return Decision(route, 400, "bad_path", f"'{route}': dot segments and empty segments are not forwarded")
    for methods, pattern, _template in _ALLOWED:
        if method in methods and pattern.fullmatch(route):
            return Decision(route)
    for reason, why, prefixes in REFUSED:
        if route.startswith(prefixes):
            return Decision(route, 403, reason, f"{method} {route} is refused by Danlu: {why}")
    return Decision(
        route,
        404,
        "route_not_forwarded",
        f"{method} {route} is not an MLflow route Danlu lets its users call (the tracking UI and "
        "clients, artifacts and registry reads are)",
    )


# user name spaces ------------------------------------------------------------------------------
def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("a key appears twice")
    return dict(pairs)


def experiment_names(body: bytes) -> list:
    """Every experiment name a create or rename request body sets, read as MLflow reads it.

    MLflow takes the JSON whatever the content type, decodes a JSON string a second time
    (old clients double-encode), and protobuf accepts each field as ``new_name`` or
    ``newName``; so every key that is ``name`` or ``new_name`` in either spelling counts.
    ValueError for a body MLflow might read otherwise (not JSON, a key twice).
    """
    data = json.loads(body or b"{}", object_pairs_hook=_no_duplicates)
    if isinstance(data, str):
        data = json.loads(data, object_pairs_hook=_no_duplicates)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return [value for key, value in data.items() if key.replace("_", "").lower() in ("name", "newname")]


def namespace_refusal(body: bytes, user: str) -> str | None:
    """Why this create/rename request may not name its experiment so (None: it may).

    ``<user>/...`` belongs to that hub user: nobody else may create an experiment there or
    rename one into it, whether or not the user exists yet (else whoever is first takes the
    name space of someone who joins later, and their jobs' default experiments are refused).
    """
    try:
        names = experiment_names(body)
    except ValueError as e:
        return f"the request body is not one JSON object MLflow would read the same way ({e})"
    for name in names:
        head, slash, _ = str(name).partition("/")
        if slash and head != user:
            return (
                f"experiment '{name}' is in the name space of '{head}': only '{head}' may create experiments "
                f"named '{head}/...'; name it '{user}/...' or leave out the '/'"
            )
    return None
