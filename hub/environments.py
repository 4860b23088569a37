"""Profile environments on one machine: kernelspecs and virtual environments.

Each profile gets a kernelspec ``danlu-<slug>`` under ``<state>/share/jupyter``
(put on ``JUPYTER_PATH`` for servers and jobs). A profile on the ``current``
environment runs the workbench's own Python; a profile with a pinned
``requirements.txt`` gets a virtual environment in ``<state>/envs/<slug>``,
built on top of the workbench's packages (so Danlu, ipykernel and papermill
are there) with the pinned versions taking precedence. An environment is
rebuilt only when its requirements file changes (its digest is stored).
"""

from __future__ import annotations

import json
import logging
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

from danlu.errors import ConfigError
from danlu.hub.profiles import Profile, ProfileSet

log = logging.getLogger(__name__)


def kernels_dir(state_dir: Path) -> Path:
    return state_dir / "share" / "jupyter" / "kernels"


def env_dir(state_dir: Path, profile: Profile) -> Path:
    return state_dir / "envs" / profile.slug


def _python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def build_environment(state_dir: Path, profile: Profile, *, pip_args: tuple[str, ...] = ()) -> Path:
    """Create or update the profile's virtual environment; returns its python."""
    venv = env_dir(state_dir, profile)
    stamp = venv / ".danlu-requirements"
    digest = profile.requirements_digest()
    if stamp.exists() and stamp.read_text().strip() == digest and _python_of(venv).exists():
        return _python_of(venv)
    log.info("building environment for profile %s from %s", profile.slug, profile.requirements_path)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(
        subprocess.run([str(_python_of(venv)), "-c", query], check=True, capture_output=True, text=True).stdout.strip()
    )
    # the workbench's packages come after the environment's own, so pins win
    base = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "_danlu_base.pth").write_text("\n".join(dict.fromkeys(base)) + "\n")
    result = subprocess.run(
        [
            str(_python_of(venv)),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            str(profile.requirements_path),
            *pip_args,
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ConfigError(
            f"building profile '{profile.slug}' from {profile.requirements_path} failed:\n"
            f"{result.stderr.strip()[-2000:]}",
            fix="fix the pins in that file (pip's message is above)",
        )
    stamp.write_text(digest or "")
    return _python_of(venv)


def write_kernelspec(state_dir: Path, profile: Profile, python: Path) -> Path:
    path = kernels_dir(state_dir) / profile.kernel_name
    path.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": profile.display_name,
        "language": "python",
        "metadata": {"danlu": {"profile": profile.slug}, "debugger": True},
    }
    (path / "kernel.json").write_text(json.dumps(spec, indent=1))
    return path


def prepare_profiles(state_dir: Path, profiles: ProfileSet) -> None:
    """Build what every profile needs on this machine (idempotent)."""
    for profile in profiles:
        if profile.requirements_path:
            python = build_environment(state_dir, profile)
        else:
            python = Path(sys.executable)
        write_kernelspec(state_dir, profile, python)
