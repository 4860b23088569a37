"""``danlu.lab``: the server part of Danlu's JupyterLab extension.

A Jupyter server extension (:class:`~danlu.lab.app.DanluLab`) that gives the
lab extension's queue sidebar, experiments view and TensorBoard tabs a REST API
under ``{base_url}danlu/api/`` and TensorBoards under
``{base_url}danlu/tensorboard/<id>/``, calling the jobs service and MLflow
server-side. The prebuilt lab extension (``npm run build`` of ``extensions/lab``)
ships beside it in ``labextension/``.

Both are installed the way Jupyter finds extensions, never passed to a server by
argument: the wheel's data files put the prebuilt extension under
``share/jupyter/labextensions/danlu-lab/`` and enable this module in
``etc/jupyter/jupyter_server_config.d/danlu.json`` (pyproject.toml); ``make install``
does the same for the editable install, whose data files setuptools leaves out
(the Makefile's ``lab-extension`` target). So any server of an environment with
danlu installed loads both: the workbench's, a kernel image's, ``jupyter lab``.
"""

from __future__ import annotations

from pathlib import Path

LABEXTENSION_NAME = "danlu-lab"


def labextension_dir() -> Path:
    """The folder holding the prebuilt lab extension (``labextension/package.json`` once built)."""
    return Path(__file__).resolve().parent / "labextension"


def _jupyter_server_extension_points():
    from danlu.lab.app import DanluLab  # deferred: jupyter_server takes ~2 s; `danlu.lab` alone stays light

    return [{"module": "danlu.lab", "app": DanluLab}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": LABEXTENSION_NAME}]
