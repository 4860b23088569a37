"""The formats of the ids and names the jobs service accepts, and how a refused value is shown in a message.

One home for every pattern a path parameter, a body field or a runner's report is matched against: job ids,
attempts and ranks, dataset names, versions and references, model names, versions, aliases and MLflow run
ids, queues and server holders, job tokens. Each pattern matches the whole text (``\\Z``, not ``$``, which
would let a trailing newline through), as the OpenAPI document's ECMA patterns do. :func:`show` and
:func:`short` put a value the caller sent into a message without letting it run long or hide control
characters.
"""

from __future__ import annotations

import re
from typing import Any

#: a job (12 hex digits)
JOB_ID = re.compile(r"^[0-9a-f]{12}\Z")
#: an attempt of a job, and a rank of an attempt
ATTEMPT = re.compile(r"^[1-9][0-9]{0,5}\Z")
RANK = re.compile(r"^(0|[1-9][0-9]{0,4})\Z")
#: a runner's job token (``secrets.token_urlsafe(32)``; its length is checked, not trusted)
JOB_TOKEN = re.compile(r"^[A-Za-z0-9_-]{20,100}\Z")
#: a team's queue (a Kubernetes name), and a notebook server holding GPUs (``user`` or ``user:name``)
QUEUE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
HOLDER = re.compile(r"^[A-Za-z0-9._@+-]{1,255}(:[A-Za-z0-9._@+-]{1,255})?\Z")
#: a dataset of the catalog, one of its versions, and a reference to one (``NAME@VERSION``, ``NAME@latest``)
DATASET = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,62}[a-z0-9])?\Z")
DATASET_VERSION = re.compile(r"^[1-9][0-9]{0,8}\Z")
DATASET_REF = re.compile(r"^([a-z0-9](?:[-a-z0-9_.]{0,62}[a-z0-9])?)@([1-9][0-9]{0,8}|latest)\Z")
#: a registered model, one of its versions, an alias of one, and an alias MLflow gives a meaning of its own
MODEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,126}[A-Za-z0-9])?\Z")
MODEL_VERSION = re.compile(r"^[1-9][0-9]{0,8}\Z")
#: the longest path of one file in a model's copy (characters): GET .../files?path= must fit a request line
#: through configurable-http-proxy (16 KiB of headers, and a character may take 12 bytes percent-encoded)
MODEL_FILE_PATH = 1024
ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}\Z")
RESERVED_ALIAS = re.compile(r"^(latest|[vV][0-9]+)\Z")
#: MLflow's run and experiment ids (a runner reports them: checked, not trusted)
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
EXPERIMENT_ID = re.compile(r"^[0-9]{1,19}\Z")


def short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def show(value: Any, limit: int = 60) -> str:
    """``repr`` short enough for a message, with surrogates, NUL and control characters escaped."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "a number of more than 4300 digits"
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"
