"""The lab extension installed the way Jupyter finds extensions, in every install, and no spawner passing it.

``pip install danlu`` must be enough for any environment (a user image on Kubernetes too) to show
Danlu in JupyterLab: the prebuilt extension under ``share/jupyter/labextensions/<package name>/`` and
the server extension enabled by ``etc/jupyter/jupyter_server_config.d/danlu.json``. setuptools' editable
install (``make install``) leaves data files out, so the Makefile's ``lab-extension`` target links and
enables them in the venv instead. Checked the way an admin would: ``jupyter labextension list`` and
``jupyter server extension list`` in

- a throwaway venv with the wheel installed (built from a copy of the sources, no ``build/`` folder left
  in the checkout, without build isolation, so no network is needed);
- a throwaway venv with the editable install of that copy plus ``make lab-extension``;
- the project's own venv (the one running these tests), which ``make install`` sets up.

The throwaway venvs see the running venv's packages (jupyterlab, jupyter_server) through a ``.pth`` line,
but their own ``sys.prefix``, so Jupyter's paths are theirs: only what the install put there is listed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from danlu.hub.profiles import builtin_profiles
from danlu.hub.spawner import DanluLocalSpawner

ROOT = Path(__file__).resolve().parents[1]
LABEXTENSION = ROOT / "extensions" / "server" / "labextension"
NAME = json.loads((ROOT / "extensions" / "lab" / "package.json").read_text())["name"]
VERSION = json.loads((ROOT / "extensions" / "lab" / "package.json").read_text())["version"]
SOURCES = [
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "magics",
    "hub",
    "extensions/server",
    "extensions/jupyter-config",
    "extensions/lab/install.json",
    "extensions/lab/package.json",
]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LISTS = ("labextension", "server extension")


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=300, **kwargs)


def quiet_env(home: Path) -> dict:
    """The environment without this checkout on PYTHONPATH and with a user config and data folder of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHONPATH"))}
    env.update(HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"))
    return env


def throwaway_venv(folder: Path) -> Path:
    """A venv of its own prefix that imports the running venv's packages; returns its python."""
    run(sys.executable, "-m", "venv", "--without-pip", str(folder))
    python = folder / "bin" / "python"
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    (Path(purelib) / "running-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


VENV_JUPYTER = """
import sys
if sys.argv[1] == "labextension":
    from jupyterlab.labextensions import main
    del sys.argv[1]
else:  # server extension
    from jupyter_server.extension.serverextension import main
    del sys.argv[1:3]
sys.exit(main())
"""


def venv_jupyter(python: Path) -> list[str]:
    """`jupyter` for a throwaway venv, which has no scripts of its own: the entry points, run by its python."""
    return [str(python), "-c", VENV_JUPYTER]


def start_lists(jupyter: list[str], env: dict) -> dict[str, subprocess.Popen]:
    """Start `jupyter labextension list` and `jupyter server extension list` (a few seconds of CPU each)."""
    return {
        what: subprocess.Popen(
            [*jupyter, *what.split(), "list"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for what in LISTS
    }


def finish_lists(started: dict[str, subprocess.Popen]) -> dict[str, str]:
    out = {}
    for what, proc in started.items():
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"jupyter {what} list failed:\n{text}"
        out[what] = ANSI.sub("", text)
    return out


@pytest.fixture(scope="module")
def installs(tmp_path_factory) -> SimpleNamespace:
    """The wheel, and what both lists say in the two throwaway venvs and in the project's venv.

    The six lists run at the same time: they are most of what this takes.
    """
    if not (LABEXTENSION / "package.json").exists():
        pytest.skip("the lab extension is not built (make install builds it into extensions/server/labextension)")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore, symlinks=False)
        elif path.exists():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, src / name)
    env = quiet_env(tmp_path_factory.mktemp("home"))
    # the project's venv (make install's .venv), with its own jupyter
    started = {"project": start_lists([str(Path(sys.executable).parent / "jupyter")], env)}

    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out), str(src))
    [built] = out.glob("danlu-*.whl")
    # --ignore-installed: never touch the danlu of the running venv, which the throwaway venvs also see
    pip = ("-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation", "--ignore-installed")
    wheel_python = throwaway_venv(tmp_path_factory.mktemp("venv") / "wheel")
    run(str(wheel_python), *pip, str(built), env=env)
    started["wheel"] = start_lists(venv_jupyter(wheel_python), env)

    editable = tmp_path_factory.mktemp("venv") / "editable"
    editable_python = throwaway_venv(editable)
    run(str(editable_python), *pip, "--config-settings", "editable_mode=strict", "-e", str(src), env=env)
    # make install's own step, after the install it comes after (-o: taken as done)
    run("make", "-s", "-C", str(ROOT), "-o", f"{editable}/.installed", f"VENV={editable}", "lab-extension", env=env)
    started["editable"] = start_lists(venv_jupyter(editable_python), env)
    return SimpleNamespace(
        wheel=zipfile.ZipFile(built),
        editable=editable,
        lists={where: finish_lists(lists) for where, lists in started.items()},
    )


def assert_enabled(lists: dict[str, str], where: str) -> None:
    labext, server = lists["labextension"], lists["server extension"]
    assert re.search(rf"^\s*{re.escape(NAME)} v{re.escape(VERSION)} enabled\s+OK", labext, re.M), (
        f"{where}: jupyter labextension list does not show {NAME} enabled and OK:\n{labext}"
    )
    assert re.search(r"^\s*danlu\.lab enabled\s*$", server, re.M), (
        f"{where}: jupyter server extension list does not show danlu.lab enabled:\n{server}"
    )
    assert re.search(r"^\s*danlu\.lab\s.*\bOK\s*$", server, re.M), f"{where}: danlu.lab does not validate:\n{server}"


def test_wheel_installs_the_prebuilt_lab_extension(installs):
    wheel = installs.wheel
    data = next(n.split("/", 1)[0] for n in wheel.namelist() if ".data/" in n)
    where = f"{data}/data/share/jupyter/labextensions/{NAME}"
    names = set(wheel.namelist())
    assert f"{where}/package.json" in names
    assert json.loads(wheel.read(f"{where}/install.json")) == {
        "packageManager": "python",
        "packageName": "danlu",
        "uninstallInstructions": "Use your Python package manager (pip, conda, etc.) to uninstall the package danlu",
    }
    static = {p.name for p in (LABEXTENSION / "static").iterdir()}
    assert static and {n.rsplit("/", 1)[1] for n in names if n.startswith(f"{where}/static/")} == static
    remote = json.loads(wheel.read(f"{where}/package.json"))["jupyterlab"]["_build"]["load"]
    assert f"{where}/{remote}" in names  # the entry point JupyterLab loads is in the wheel
    assert f"{where}/schemas/{NAME}/plugin.json" in names


def test_wheel_enables_the_server_extension(installs):
    wheel = installs.wheel
    data = next(n.split("/", 1)[0] for n in wheel.namelist() if ".data/" in n)
    config = json.loads(wheel.read(f"{data}/data/etc/jupyter/jupyter_server_config.d/danlu.json"))
    assert config == {"ServerApp": {"jpserver_extensions": {"danlu.lab": True}}}


def test_a_wheel_install_lists_both_extensions_enabled(installs):
    assert_enabled(installs.lists["wheel"], "a venv with danlu's wheel")
    assert "(python, danlu)" in installs.lists["wheel"]["labextension"]  # install.json: uninstall with pip


def test_an_editable_install_lists_both_extensions_enabled(installs):
    assert_enabled(installs.lists["editable"], "a venv with the editable install and make lab-extension")
    link = installs.editable / "share" / "jupyter" / "labextensions" / NAME
    assert link.is_symlink() and link.resolve() == LABEXTENSION.resolve()  # a rebuild shows at once, as develop's


def test_the_project_venv_lists_both_extensions_enabled(installs):
    """The venv these tests run in (``make install``'s .venv), with its own ``jupyter``."""
    assert_enabled(installs.lists["project"], f"{sys.prefix} (make install sets it up)")


def test_no_spawner_passes_the_lab_extension_by_argument():
    spawner = DanluLocalSpawner(user=SimpleNamespace(name="alice", url="/user/alice/"))
    spawner.profile = next(iter(builtin_profiles()))
    args = spawner.get_args()
    loading = re.compile(r"jpserver_extensions|labextensions_path|danlu[.-]lab")
    assert not [a for a in args if loading.search(a)], args
    assert args == spawner.get_args() and spawner.args == []  # JupyterHub's own list is left as it was
    # the Kubernetes spawner and the rendered chart values: nothing in hub/ or helm-values/ passes it either
    for path in [*sorted((ROOT / "hub").rglob("*.py")), *sorted((ROOT / "helm-values").rglob("*.yaml"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"jpserver_extensions|labextensions_path", line), f"{path}:{number}: {line}"


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists Danlu's packages one by one: a new package folder left off the list is missing
    from the wheel, the unix tier's installation and the images, while tests that import from the checkout
    still pass (the sweeps package was, once)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    found = set()
    for package, folder in project["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts or "node_modules" in init.parts:
                continue
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
