"""What Danlu's own processes leave out of their imports, and why (one home for such choices).

``jsonschema`` (imported by nbformat, papermill, jupyter_events and so by JupyterHub) looks
for ``rfc3987_syntax`` when it is imported, to check the ``iri`` formats, and that library
builds a Lark grammar at import time: 1-2 s of CPU and about 25 MB in every process that
imports jsonschema (python-jsonschema/jsonschema#1392; its lazy fork is not what jsonschema
imports). None of Danlu's processes validates an ``iri`` format, so :func:`skip_unused_imports`
tells Python the module is absent before anything imports jsonschema, and jsonschema leaves
those two format checks out, as it does wherever the module is not installed.

Only Danlu's own processes call it (``danlu up``, JupyterHub as ``danlu up`` starts it, the
jobs service, the MLflow gateway, job runners); never a user's kernel, whose imports are the
user's business.
"""

from __future__ import annotations

import sys

#: Modules that Danlu's processes never use but their dependencies import for a feature they do not use.
UNUSED = ("rfc3987_syntax",)


def skip_unused_imports() -> None:
    """Mark :data:`UNUSED` as not installed (an ``import`` of one raises ImportError), unless already imported."""
    for name in UNUSED:
        sys.modules.setdefault(name, None)
