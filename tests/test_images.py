"""Pure tests of the image recipes under kernel-images/: one per governed profile, plus the hub's.

Every FROM is pinned by digest, a profile's image installs exactly its pinned requirements file, and
the hub image is built on the hub image of the chart version the renderer targets. One set of versions:
JupyterHub, KubeSpawner, JupyterLab and MLflow are pinned in pyproject.toml alone, the venv the tests
run in has exactly those, and every image gets them through danlu's wheel. Building and pushing are
docs/kubernetes.md's ("Images"); no docker here.
"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from danlu.hub.k8s import values
from danlu.hub.profiles import load_profiles

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "kernel-images"
PROFILES = load_profiles(IMAGES / "profiles.yaml")
FROM = re.compile(r"^FROM\s+(?P<ref>\S+)", re.MULTILINE)
PINNED = re.compile(r"^(?P<name>[^@\s:]+(?::\d+)?(?:/[^@\s:]+)*)(?::(?P<tag>[\w.-]+))?@sha256:[0-9a-f]{64}$")
COPY = re.compile(r"^COPY\s+(?:--\S+\s+)*(?P<sources>.+?)\s+\S+$", re.MULTILINE)
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
KERNEL_DOCKERFILES = [d for d in DOCKERFILES if d.parent.name != "hub"]
#: the versions the hub, its spawner, every JupyterLab and MLflow must agree on (issue 16)
ONE_SET = ("jupyterhub", "jupyterhub-kubespawner", "jupyterlab", "mlflow")
#: a pip install of danlu's wheel (optionally with extras) that keeps its dependencies
WHEEL_INSTALL = re.compile(r'^RUN pip install (?:--no-cache-dir )?(?:"\$\(ls )?/tmp/danlu/danlu-\*\.whl', re.MULTILINE)

#: a line that names a version of one of them (a pin or range in a RUN line or a requirements file)
NAMES_A_VERSION = re.compile(rf"\b({'|'.join(map(re.escape, ONE_SET))})\b\s*(\[[^\]]*\])?\s*[=<>~!]", re.IGNORECASE)


def pins() -> dict[str, str]:
    """pyproject.toml's exact pins of :data:`ONE_SET`, by package name."""
    requirements = [
        Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    found = {}
    for r in requirements:
        if r.name in ONE_SET:
            [spec] = r.specifier  # one specifier, ==, nothing else
            assert spec.operator == "==", f"pyproject.toml: {r} is a range; pin it with =="
            found[r.name] = spec.version
    return found


def froms(path: Path) -> list[str]:
    return FROM.findall(path.read_text())


def copied_requirements(path: Path) -> set[str]:
    return {src for m in COPY.finditer(path.read_text()) for src in m["sources"].split() if src.endswith(".txt")}


def test_every_profile_has_a_dockerfile():
    assert {p.slug for p in PROFILES} <= {d.parent.name for d in DOCKERFILES}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda d: d.parent.name)
def test_every_from_is_pinned_by_digest(dockerfile):
    refs = froms(dockerfile)
    assert refs, f"{dockerfile} has no FROM"
    for ref in refs:
        assert PINNED.match(ref), f"{dockerfile}: FROM {ref} is not pinned by digest (name[:tag]@sha256:<64 hex>)"
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("FROM "):  # says where the digest comes from (or that it is a placeholder)
            assert "digest" in lines[i - 1] and lines[i - 1].startswith("#"), f"{dockerfile}:{i + 1}"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.slug)
def test_a_profile_image_installs_exactly_its_pinned_requirements(profile):
    dockerfile = IMAGES / profile.slug / "Dockerfile"
    expected = {str(profile.requirements_path.relative_to(ROOT))} if profile.requirements_path else set()
    assert copied_requirements(dockerfile) == expected
    text = dockerfile.read_text()
    if expected:
        assert re.search(r"pip install [^\n]*-r /tmp/danlu/requirements\.txt", text)
    assert "dist/danlu-" in text, "the image installs danlu"


def test_the_hub_image_is_the_charts():
    (ref,) = froms(IMAGES / "hub" / "Dockerfile")
    match = PINNED.match(ref)
    assert (match["name"], match["tag"]) == ("quay.io/jupyterhub/k8s-hub", values.CHART_VERSION)
    assert (ROOT / "tests" / "schemas" / "z2jh" / values.CHART_VERSION / "values.schema.json").exists()


def test_the_pin_check_catches_an_unpinned_from():
    assert not PINNED.match("quay.io/jupyter/pytorch-notebook:latest")
    assert not PINNED.match("quay.io/jupyterhub/k8s-hub:4.4.0@sha256:abc")
    assert PINNED.match("localhost:5000/danlu/hub:1.0@sha256:" + "ab" * 32)
    assert NAMES_A_VERSION.search('RUN pip install "mlflow[auth]>=3.0" jupyterlab==4.2.0')
    assert NAMES_A_VERSION.search("jupyterhub-kubespawner == 7.0.0")
    assert not NAMES_A_VERSION.search("RUN pip install --no-cache-dir /tmp/danlu/danlu-*.whl")


# one set of versions ------------------------------------------------------------------------------------------
def test_pyproject_pins_one_set_of_versions():
    assert set(pins()) == set(ONE_SET)


def test_the_venv_runs_the_pinned_versions():
    installed = {name: version(name) for name in ONE_SET}
    assert installed == pins(), "the venv runs other versions than pyproject.toml pins: run make install"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda d: d.parent.name)
def test_every_image_takes_the_versions_from_danlus_wheel(dockerfile):
    text = dockerfile.read_text()
    assert WHEEL_INSTALL.search(text), f"{dockerfile} does not pip install danlu's wheel with its dependencies"
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "--no-deps" not in code, f"{dockerfile}: --no-deps would keep the base image's versions"
    files = [dockerfile, *sorted(dockerfile.parent.glob("*.txt"))]
    for path in files:
        for line in path.read_text().splitlines():
            if not line.lstrip().startswith("#"):
                assert not NAMES_A_VERSION.search(line), (
                    f"{path}: {line!r} pins a version that only pyproject.toml names"
                )


@pytest.mark.parametrize("path", ["kernel-images/hub/Dockerfile", "docs/kubernetes.md"])
def test_the_notes_name_the_pinned_versions(path):
    """The hub image's note and the Kubernetes guide say which versions Danlu runs: pyproject.toml's."""
    note = " ".join(line.lstrip("# ") for line in (ROOT / path).read_text().splitlines())
    p = pins()
    for words in (
        f"JupyterHub {p['jupyterhub']}",
        f"KubeSpawner {p['jupyterhub-kubespawner']}",
        f"JupyterLab {p['jupyterlab']}",
        f"MLflow {p['mlflow']}",
    ):
        assert words in note, f"{path} does not say {words!r} (pyproject.toml's pin)"


@pytest.mark.parametrize("dockerfile", KERNEL_DOCKERFILES, ids=lambda d: d.parent.name)
def test_a_kernel_image_checks_that_the_lab_extension_is_installed(dockerfile):
    text = dockerfile.read_text()
    assert "jupyter labextension list" in text and "danlu-lab .*enabled.*OK" in text
    assert "jupyter server extension list" in text and "danlu.lab .*enabled" in text
    assert text.index("jupyter labextension list") > WHEEL_INSTALL.search(text).start()  # after the install
