"""Pure tests of governed profiles: loading ``profiles.yaml`` and the one authorization check.

:func:`danlu.hub.profiles.load_profiles` must stop on a bad file with a message
naming the file and line; :meth:`ProfileSet.authorize` must refuse with a
reason and a message that names the profile and the groups involved.
"""

from __future__ import annotations

import textwrap

import pytest

from danlu.errors import ConfigError, NotFound, PolicyError, ValidationError
from danlu.hub.profiles import ProfileSet, load_profiles

DIGEST = "0" * 64

VALID = """
profiles:
  - slug: python
    display_name: Python
    environment:
      current: true
    resources:
      gpus: [0, 1]
  - slug: pytorch
    display_name: PyTorch (pinned)
    default: true
    environment:
      requirements: pytorch/requirements.txt
      image: registry.example.org/pytorch@sha256:{digest}
    resources:
      cpu: 8
      memory: 32G
      gpus: [4, 0, 2, 2]
  - slug: gpu-vision
    display_name: Vision GPUs
    environment:
      current: true
    resources:
      gpus: [1, 2]
    groups: [vision, admins-vision]
"""


def write_profiles(folder, text: str, requirements: str | None = "torch==2.13.0\nnumpy==2.4.6\n"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "profiles.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n").replace("{digest}", DIGEST), encoding="utf-8")
    if requirements is not None:
        (folder / "pytorch").mkdir(exist_ok=True)
        (folder / "pytorch" / "requirements.txt").write_text(requirements, encoding="utf-8")
    return path


@pytest.fixture
def profiles(tmp_path) -> ProfileSet:
    return load_profiles(write_profiles(tmp_path / "kernel-images", VALID))


def line_number(path, fragment: str) -> int:
    """The line of ``path`` that holds ``fragment`` (first match), as an editor shows it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, 1) if fragment in line)


def load_error(path) -> str:
    with pytest.raises(ConfigError) as info:
        load_profiles(path)
    return str(info.value)


# loading ----------------------------------------------------------------------------


def test_valid_file_loads_every_profile(tmp_path):
    folder = tmp_path / "kernel-images"

    profiles = load_profiles(write_profiles(folder, VALID))

    assert profiles.slugs == ["python", "pytorch", "gpu-vision"]
    pytorch = profiles.get("pytorch")
    assert pytorch.gpu_choices == (0, 2, 4)
    assert pytorch.max_gpus == 4
    assert pytorch.cpu == 8 and pytorch.memory == "32G"
    assert pytorch.requirements_path == (folder / "pytorch" / "requirements.txt").resolve()
    assert pytorch.kernel_name == "danlu-pytorch"
    assert not pytorch.uses_current_environment
    assert profiles.get("python").uses_current_environment
    assert profiles.get("gpu-vision").groups == ("vision", "admins-vision")
    assert profiles.source == str(folder / "profiles.yaml")


def test_duplicate_slug_names_the_line_and_first_use(tmp_path):
    path = write_profiles(
        tmp_path,
        """
        profiles:
          - slug: python
            display_name: One
            environment: {current: true}
          - slug: python  # again
            display_name: Two
            environment: {current: true}
    """,
    )

    message = load_error(path)

    line = line_number(path, "# again")
    assert message.startswith(f"{path}:{line}: profiles[1].slug: 'python' is already used by profiles[0]")


def test_unpinned_requirement_names_requirements_file_and_line(tmp_path):
    path = write_profiles(tmp_path, VALID, requirements="# pinned on purpose\ntorch==2.13.0\nnumpy>=2\n")

    message = load_error(path)

    assert message.startswith(f"{tmp_path / 'pytorch' / 'requirements.txt'}:3: 'numpy>=2' is not pinned")
    assert "==" in message  # the fix shows how to pin


@pytest.mark.parametrize("line", ["numpy", "numpy~=2.1", "numpy==2.1,<3", "-e git+https://example.org/x.git"])
def test_other_unpinned_forms_are_refused(tmp_path, line):
    path = write_profiles(tmp_path, VALID, requirements=f"torch==2.13.0\n{line}\n")

    assert ":2: " in load_error(path)


def test_pins_with_extras_markers_and_local_versions_are_accepted(tmp_path):
    requirements = "torch==2.13.0+cpu\nuvicorn[standard]==0.30.0\ncolorama==0.4.6 ; sys_platform == 'win32'\n"

    profiles = load_profiles(write_profiles(tmp_path, VALID, requirements=requirements))

    assert profiles.get("pytorch").requirements_digest() is not None


def test_wildcard_version_is_not_a_pin(tmp_path):
    path = write_profiles(tmp_path, VALID, requirements="torch==2.13.0\nnumpy==2.*\n")

    assert ":2: 'numpy==2.*' is not pinned" in load_error(path)


def test_included_requirements_files_are_refused(tmp_path):
    # an included file could bring unpinned packages past the check
    path = write_profiles(tmp_path, VALID, requirements="torch==2.13.0\n-r extra.txt\n")
    (tmp_path / "pytorch" / "extra.txt").write_text("numpy\n", encoding="utf-8")

    assert ":2: '-r extra.txt' is not allowed in a governed environment" in load_error(path)


def test_missing_requirements_file_is_named(tmp_path):
    path = write_profiles(tmp_path, VALID, requirements=None)

    message = load_error(path)

    assert message.startswith(f"{path}:{line_number(path, 'requirements:')}: requirements file")
    assert "does not exist" in message


@pytest.mark.parametrize("requirements", ["../outside.txt", "pytorch/../../outside.txt", "/etc/passwd"])
def test_requirements_path_must_stay_in_the_folder(tmp_path, requirements):
    folder = tmp_path / "kernel-images"
    (tmp_path / "outside.txt").write_text("torch==2.13.0\n", encoding="utf-8")
    path = write_profiles(folder, VALID.replace("pytorch/requirements.txt", requirements))

    message = load_error(path)

    line = line_number(path, "requirements:")
    assert message.startswith(f"{path}:{line}: profiles[1].environment.requirements must stay inside {folder}")


def test_image_must_be_pinned_by_digest(tmp_path):
    path = write_profiles(tmp_path, VALID.replace("@sha256:{digest}", ":latest"))

    message = load_error(path)

    assert message.startswith(f"{path}:{line_number(path, 'image:')}: profiles[1].environment.image:")
    assert "pin the image by digest" in message


def test_two_defaults_are_refused(tmp_path):
    path = write_profiles(
        tmp_path,
        """
        profiles:
          - slug: python
            display_name: Python
            default: true
            environment: {current: true}
          - slug: other
            display_name: Other
            default: true
            environment: {current: true}
    """,
        requirements=None,
    )

    message = load_error(path)

    assert message.startswith(f"{path}: profiles python, other are all marked default")
    assert "mark only one" in message


def test_unknown_key_in_a_profile_suggests_the_right_one(tmp_path):
    path = write_profiles(tmp_path, VALID.replace("    groups: [vision", "    group: [vision"))

    message = load_error(path)

    assert message.startswith(f"{path}:{line_number(path, 'group:')}: profiles[2].group: unknown key")
    assert "did you mean 'groups'?" in message


# authorize --------------------------------------------------------------------------


def test_member_of_an_allowed_group_gets_the_profile(profiles):
    profile = profiles.authorize("gpu-vision", ["research", "vision"], gpus=2)

    assert profile.slug == "gpu-vision"


def test_profile_without_groups_is_open_to_everyone(profiles):
    assert profiles.authorize("python", []).slug == "python"


def test_outsider_is_refused_with_profile_and_groups_named(profiles):
    with pytest.raises(PolicyError) as info:
        profiles.authorize("gpu-vision", ["research"])

    error = info.value
    assert error.reason == "profile_not_allowed"
    assert error.status == 403
    assert error.field == "profile"
    assert "'gpu-vision'" in error.message
    assert "vision, admins-vision" in error.message
    assert "you are in research" in error.message


def test_user_without_groups_is_told_so(profiles):
    with pytest.raises(PolicyError) as info:
        profiles.authorize("gpu-vision", [])

    assert "you are in no groups" in info.value.message


def test_admin_bypasses_groups(profiles):
    assert profiles.authorize("gpu-vision", [], admin=True).slug == "gpu-vision"


def test_unknown_profile_lists_valid_slugs(profiles):
    with pytest.raises(NotFound) as info:
        profiles.authorize("tensorflow", ["vision"])

    assert info.value.reason == "unknown_profile"
    assert info.value.status == 404
    assert str(info.value) == "unknown profile 'tensorflow' (choose one of: python, pytorch, gpu-vision)"


def test_jobs_may_ask_any_count_up_to_the_largest_choice(profiles):
    assert profiles.authorize("pytorch", [], gpus=3).slug == "pytorch"


def test_too_many_gpus_is_refused(profiles):
    with pytest.raises(PolicyError) as info:
        profiles.authorize("pytorch", [], gpus=5)

    assert info.value.reason == "too_many_gpus"
    assert "at most 4 GPUs, 5 asked" in str(info.value)


def test_server_choice_accepts_only_offered_counts(profiles):
    assert profiles.authorize("pytorch", [], gpus=2, server_choice=True).slug == "pytorch"
    with pytest.raises(PolicyError) as info:
        profiles.authorize("pytorch", [], gpus=3, server_choice=True)

    assert info.value.reason == "gpus_not_offered"
    assert "offers 0, 2, 4 GPUs, not 3" in str(info.value)


@pytest.mark.parametrize("gpus", [-1, True, 1.5])
def test_gpu_count_must_be_a_whole_number(profiles, gpus):
    with pytest.raises(ValidationError) as info:
        profiles.authorize("python", [], gpus=gpus)

    assert info.value.field == "gpus"


def test_no_slug_gives_the_default_profile(profiles):
    assert profiles.default.slug == "pytorch"
    assert profiles.authorize(None, []).slug == "pytorch"


def test_no_slug_falls_back_to_first_allowed_when_default_is_restricted(tmp_path):
    profiles = load_profiles(
        write_profiles(
            tmp_path,
            """
        profiles:
          - slug: open
            display_name: Open
            environment: {current: true}
          - slug: team
            display_name: Team only
            default: true
            environment: {current: true}
            groups: [vision]
    """,
            requirements=None,
        )
    )

    assert profiles.authorize(None, ["research"]).slug == "open"
    assert profiles.authorize(None, ["vision"]).slug == "team"


def test_no_slug_and_nothing_allowed_is_refused(tmp_path):
    profiles = load_profiles(
        write_profiles(
            tmp_path,
            """
        profiles:
          - slug: team
            display_name: Team only
            environment: {current: true}
            groups: [vision]
    """,
            requirements=None,
        )
    )

    with pytest.raises(PolicyError) as info:
        profiles.authorize(None, ["research"])

    assert info.value.reason == "no_profile"
