"""Pure tests of the image recipes under kernel-images/: one per governed profile, plus the hub's.

Every FROM is pinned by digest, a profile's image installs exactly its pinned requirements file, and
the hub image is built on the hub image of the chart version the renderer targets. Building and
pushing are docs/kubernetes.md's ("Images"); no docker here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from danlu.hub.k8s import values
from danlu.hub.profiles import load_profiles

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "kernel-images"
PROFILES = load_profiles(IMAGES / "profiles.yaml")
FROM = re.compile(r"^FROM\s+(?P<ref>\S+)", re.MULTILINE)
PINNED = re.compile(r"^(?P<name>[^@\s:]+(?::\d+)?(?:/[^@\s:]+)*)(?::(?P<tag>[\w.-]+))?@sha256:[0-9a-f]{64}$")
COPY = re.compile(r"^COPY\s+(?:--\S+\s+)*(?P<sources>.+?)\s+\S+$", re.MULTILINE)
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


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
