"""The live job card ``%%train`` shows: an ipywidgets view that follows a job.

A background thread polls the jobs service (the job every second, the last log
lines with it) and updates the widgets until the job ends; interrupting the
kernel stops nothing. The card shows the state, the queue position and why the
job waits, the elapsed time, how its MLflow tracking went when something was
lost (dropped points, the runner's notes), the last log lines, links to the
output notebook and the MLflow run, and a Cancel button.
"""

from __future__ import annotations

import html
import threading
import time

from IPython.display import display

from danlu.states import FINAL_STATES as FINAL

COLORS = {
    "queued": "#8a6d00",
    "running": "#1565c0",
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "cancelled": "#616161",
    "preempted": "#6a1b9a",
    "timed_out": "#c62828",
}


def summary_html(job: dict) -> str:
    state = job["state"]
    parts = [
        f"<b>{html.escape(job['name'])}</b> <code>{job['id']}</code> "
        f'<span style="color:#fff;background:{COLORS.get(state, "#444")};padding:1px 6px;border-radius:3px">'
        f"{state}</span>"
    ]
    if state == "queued":
        pos = job.get("queue_position")
        parts.append(f"position {pos} in {html.escape(job.get('queue', 'default'))}" if pos else "queued")
        if job.get("estimated_start"):
            parts.append(f"starts ~{html.escape(job['estimated_start'][11:16])} UTC")
    if job.get("reason"):
        parts.append(html.escape(job["reason"]))
    if job.get("elapsed_seconds") is not None:
        parts.append(f"{job['elapsed_seconds']:.0f} s")
    saved = job.get("checkpoint")
    if isinstance(saved, dict):  # the last checkpoint its code reported
        parts.append(f"checkpoint step {int(saved['step'])}, {saved['age_seconds']:.0f} s old")
    resources = job.get("resources", {})
    parts.append(f"{resources.get('nproc', 1)} proc, {resources.get('gpus', 0)} GPU · {html.escape(job['profile'])}")
    tracking = job.get("tracking") or {}
    if tracking.get("state") == "degraded":
        dropped = tracking.get("points_dropped") or 0
        detail = "; ".join(str(n) for n in (tracking.get("notes") or [])[:3])
        parts.append(
            '<span style="color:#8a6d00">MLflow: '
            + (f"{dropped} metric point(s) not recorded" if dropped else "see notes")
            + (f" ({html.escape(detail)})" if detail else "")
            + "</span>"
        )
    elif tracking.get("state") == "none" and state in FINAL:
        parts.append('<span style="color:#8a6d00">no MLflow run</span>')
    links = []
    if job.get("output_url") and state in FINAL | {"running"}:
        links.append(f'<a href="{html.escape(job["output_url"])}?format=html" target="_blank">output notebook</a>')
    if job.get("mlflow_run_url"):
        links.append(f'<a href="{html.escape(job["mlflow_run_url"])}" target="_blank">MLflow run</a>')
    return " · ".join(parts) + ("<br>" + " · ".join(links) if links else "")


class JobCard:
    def __init__(self, client, job: dict, interval: float = 1.0, log_lines: int = 12):
        self.client = client
        self.job = job
        self.interval = interval
        self.log_lines = log_lines

    def _widgets(self):
        import ipywidgets as w  # deferred: ipywidgets takes ~65 ms; %load_ext danlu imports this module

        self.header = w.HTML(summary_html(self.job))
        self.log = w.HTML("")
        self.cancel_button = w.Button(
            description="Cancel job", button_style="danger", icon="stop", tooltip=f"Cancel job {self.job['id']}"
        )
        self.cancel_button.on_click(self._cancel)
        self.box = w.VBox(
            [self.header, self.log, self.cancel_button], layout=w.Layout(border="1px solid #ccc", padding="6px")
        )
        return self.box

    def _cancel(self, _button):
        self.cancel_button.disabled = True
        try:
            self.job = self.client.cancel(self.job["id"])
        except Exception as e:
            self.log.value = f"<pre>cancel failed: {html.escape(str(e))}</pre>"
        self._render("")

    def _render(self, tail: str):
        self.header.value = summary_html(self.job)
        if tail:
            self.log.value = (
                f'<pre style="max-height:14em;overflow:auto;font-size:85%;margin:4px 0">{html.escape(tail)}</pre>'
            )
        if self.job["state"] in FINAL:
            self.cancel_button.layout.display = "none"

    def _loop(self):
        while True:
            try:
                self.job = self.client.job(self.job["id"])
                tail = "".join(self.client.logs(self.job["id"], tail=self.log_lines))
                self._render(tail)
            except Exception as e:  # the service restarting: keep trying
                self.header.value = summary_html(self.job) + f"<br><i>{html.escape(str(e))}</i>"
            if self.job["state"] in FINAL:
                return
            time.sleep(self.interval)

    def show(self) -> "JobCard":
        display(self._widgets())
        threading.Thread(target=self._loop, name=f"danlu-card-{self.job['id']}", daemon=True).start()
        return self
