"""``danlu.lab``: the server part of Danlu's JupyterLab extension.

A Jupyter server extension (:class:`~danlu.lab.app.DanluLab`) that gives the
lab extension's queue sidebar, experiments view and TensorBoard tabs a REST API
under ``{base_url}danlu/api/`` and TensorBoards under
``{base_url}danlu/tensorboard/<id>/``, calling the jobs service and MLflow
server-side. The prebuilt lab extension (``npm run build`` of ``extensions/lab``)
ships beside it in ``labextension/``; Danlu's spawner loads both into every
server (:func:`server_args`).
"""

from __future__ import annotations

import os
from pathlib import Path

LABEXTENSION_NAME = "danlu-lab"


def labextension_dir() -> Path:
    """The folder holding the prebuilt lab extension (``labextension/package.json`` once built)."""
    return Path(__file__).resolve().parent / "labextension"


def link_labextension(folder: Path) -> Path:
    """Make ``folder/danlu-lab`` point at :func:`labextension_dir`; return ``folder``.

    JupyterLab serves a prebuilt extension from ``<labextensions path>/<package name>/``, while the
    build writes it to ``labextension/`` in this package; the link joins the two without a copy
    that could go stale when the extension is rebuilt.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / LABEXTENSION_NAME
    target = labextension_dir()
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return folder
    if link.is_symlink() or link.exists():
        link.unlink()
    tmp = folder / f".{LABEXTENSION_NAME}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)  # atomic: a server starting meanwhile sees the old link or the new one
    return folder


def server_args(labextensions: Path) -> list[str]:
    """Options that make a Jupyter server load ``danlu.lab`` and the prebuilt lab extension.

    ``labextensions`` is a folder this function links the lab extension into (see
    :func:`link_labextension`); it becomes one of JupyterLab's extra labextensions paths.
    """
    return [
        "--ServerApp.jpserver_extensions=danlu.lab=True",
        f"--LabServerApp.extra_labextensions_path={link_labextension(labextensions)}",
    ]


def _jupyter_server_extension_points():
    from danlu.lab.app import DanluLab  # deferred: jupyter_server takes ~2 s; the spawner imports danlu.lab too

    return [{"module": "danlu.lab", "app": DanluLab}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": LABEXTENSION_NAME}]
