"""The HTML the jobs service serves to browsers: the jobs page, and notebooks rendered for reading.

A job's notebook is the job's content, and a job can put anything in it:
``<script>``, event handlers, iframes, SVG with script. Rendered on the hub's
origin it would run with the viewer's session, and an admin opens every
user's outputs. So :func:`render_notebook` renders with nbconvert's
sanitizer (``HTMLExporter(sanitize_html=True)``: untrusted output is cleaned,
as JupyterLab does for untrusted notebooks) and serves the page with a
Content-Security-Policy ``sandbox`` without ``allow-same-origin`` and without
``allow-scripts``: the page gets an opaque origin and runs no script at all,
whatever got past the sanitizer. Rendering runs off the event loop, on at
most :data:`MAX_HTML` bytes, and at most ``JobsServiceApp.max_html_renders``
at once: a request beyond gets a 503 with ``Retry-After`` at once, never a
wait behind someone else's renders.
"""

from __future__ import annotations

import asyncio
import html
import json

import nbformat

from danlu.errors import DanluError
from danlu.hub.service.api.web import APIHandler

MAX_HTML = 32 * 1024 * 1024
CSP = (
    "sandbox; default-src 'none'; img-src data:; style-src 'unsafe-inline'; font-src data:; "
    "form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)


def notebook_html(data: bytes) -> str:
    """A notebook as a standalone, sanitized HTML page (nbconvert's lab template)."""
    # deferred: nbconvert takes ~0.5 s to import; only a notebook shown as HTML needs it
    from nbconvert import HTMLExporter

    try:
        node = nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as e:  # noqa: BLE001 - the job's content: anything may be in it
        raise DanluError(
            f"the notebook cannot be rendered: {str(e)[:200]}",
            status=409,
            reason="bad_notebook",
            fix="download it as ipynb (leave out format=html)",
        ) from None
    exporter = HTMLExporter(template_name="lab", sanitize_html=True, embed_images=False)
    body, _ = exporter.from_notebook_node(node)
    return body


async def render_notebook(handler: APIHandler, data: bytes) -> None:
    if len(data) > MAX_HTML:
        raise DanluError(
            f"the notebook is {len(data) // 2**20} MiB, too large to show as HTML",
            status=413,
            reason="too_large",
            fix="download it as ipynb (leave out format=html)",
        )
    slots: asyncio.Semaphore = handler.settings.get("danlu_html_renders") or asyncio.Semaphore(1)
    if slots.locked():
        busy = DanluError(
            "the service is rendering as many notebooks as it may at once",
            status=503,
            reason="renders_busy",
            fix="try again in a few seconds, or download the notebook as ipynb (leave out format=html)",
        )
        busy.retry_after = 5
        raise busy
    async with slots:
        page = await asyncio.get_running_loop().run_in_executor(None, notebook_html, data)
    handler.set_header("Content-Type", "text/html; charset=utf-8")
    handler.set_header("Content-Security-Policy", CSP)
    handler.set_header("X-Frame-Options", "DENY")
    handler.set_header("Referrer-Policy", "no-referrer")
    handler.finish(page)


class JobsPageHandler(APIHandler):
    """``/services/danlu/``: the caller's jobs as a plain HTML page (the hub's Services menu links here)."""

    login_redirect = True

    async def get(self):
        who = self.principal()
        # the views GET /jobs sends, built off the event loop (and, for ended jobs, kept encoded)
        rows = []
        for info in json.loads(await self.manager.page_json(who, limit=200))["jobs"]:
            links = [f'<a href="{html.escape(info["logs_url"])}">log</a>']
            if info["state"] in ("running", "succeeded", "failed"):
                links.append(f'<a href="{html.escape(info["output_url"])}?format=html">output</a>')
            if info["mlflow_run_url"]:
                links.append(f'<a href="{html.escape(info["mlflow_run_url"])}">MLflow run</a>')
            rows.append(
                f"<tr><td><code>{html.escape(info['id'])}</code></td><td>{html.escape(info['name'])}</td>"
                f"<td>{html.escape(info['owner'])}</td><td>{html.escape(info['state'])}</td>"
                f"<td>{html.escape(info['reason'] or '')}</td><td>{info['created_at']}</td>"
                f"<td>{' · '.join(links)}</td></tr>"
            )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header(
            "Content-Security-Policy",
            "default-src 'none'; style-src 'unsafe-inline'; "
            "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        )
        self.finish(
            "<!doctype html><html><head><meta charset='utf-8'><title>Danlu jobs</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.3em .8em;text-align:left}"
            "tr:nth-child(even){background:#f4f4f4}</style></head><body>"
            f"<h1>Danlu jobs</h1><p>{html.escape(who.name)}{' (admin: every job)' if who.admin else ''} · "
            "<a href='/hub/home'>hub</a> · <a href='/services/mlflow/'>MLflow</a> · "
            "<a href='api/v1/openapi.json'>API</a></p>"
            "<table><tr><th>id</th><th>name</th><th>owner</th><th>state</th><th>reason</th><th>submitted</th>"
            f"<th></th></tr>{''.join(rows) or '<tr><td colspan=7>no jobs yet</td></tr>'}</table></body></html>"
        )
