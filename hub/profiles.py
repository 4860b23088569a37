"""Governed profiles: what users may run, from ``kernel-images/profiles.yaml``.

A profile names an environment (the workbench's own Python, a virtual
environment built from a pinned ``requirements.txt``, or on Kubernetes an image
pinned by digest), its resources (CPU, memory, the GPU counts a user may pick)
and the groups allowed to use it. :func:`load_profiles` validates the file with
line-accurate errors; :meth:`ProfileSet.authorize` is the single server-side
check used by the spawner (form, API and ``user_options``) and by the jobs
service, so a refusal always names the profile and the reason.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from danlu.errors import ConfigError, NotFound, PolicyError, ValidationError
from danlu.hub import yamlconfig

PIN = re.compile(
    r"^\s*[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*==\s*[^=<>~!\s,;*]+"
    r"(\s*;[^-]*)?(\s+--hash=[a-z0-9]+:[0-9a-f]+)*\s*$"
)


@dataclass(frozen=True)
class Profile:
    slug: str
    display_name: str
    description: str = ""
    default: bool = False
    environment: dict = field(default_factory=dict)
    cpu: float | None = None
    memory: str | None = None
    gpu_choices: tuple[int, ...] = (0,)
    groups: tuple[str, ...] = ()
    requirements_path: Path | None = None
    gpu_idle_timeout_seconds: int | None = None  # None: hub.gpu_idle_timeout_seconds

    @property
    def kernel_name(self) -> str:
        """The kernelspec name jobs and servers of this profile use."""
        return f"danlu-{self.slug}"

    @property
    def max_gpus(self) -> int:
        return max(self.gpu_choices)

    @property
    def uses_current_environment(self) -> bool:
        return bool(self.environment.get("current")) or not (self.requirements_path or self.environment.get("image"))

    def allows(self, groups, *, admin: bool = False) -> bool:
        return admin or not self.groups or bool(set(self.groups) & set(groups))

    def requirements_digest(self) -> str | None:
        if not self.requirements_path:
            return None
        return hashlib.sha256(self.requirements_path.read_bytes()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "slug": self.slug,
            "display_name": self.display_name,
            "description": self.description,
            "default": self.default,
            "environment": dict(self.environment),
            "resources": {"cpu": self.cpu, "memory": self.memory, "gpus": list(self.gpu_choices)},
            "groups": list(self.groups),
            "kernel_name": self.kernel_name,
        }


@dataclass(frozen=True)
class ProfileSet:
    profiles: tuple[Profile, ...]
    source: str = "profiles.yaml"

    def __iter__(self):
        return iter(self.profiles)

    @property
    def slugs(self) -> list[str]:
        return [p.slug for p in self.profiles]

    @property
    def default(self) -> Profile:
        return next((p for p in self.profiles if p.default), self.profiles[0])

    def get(self, slug: str) -> Profile:
        for profile in self.profiles:
            if profile.slug == slug:
                return profile
        raise NotFound(
            f"unknown profile '{slug}'",
            reason="unknown_profile",
            field="profile",
            fix=f"choose one of: {', '.join(self.slugs)}",
        )

    def for_user(self, groups, *, admin: bool = False) -> list[Profile]:
        return [p for p in self.profiles if p.allows(groups, admin=admin)]

    def default_for(self, groups, *, admin: bool = False) -> Profile | None:
        allowed = self.for_user(groups, admin=admin)
        return next((p for p in allowed if p.default), allowed[0] if allowed else None)

    def authorize(
        self,
        slug: str | None,
        groups,
        *,
        admin: bool = False,
        gpus: int = 0,
        server_choice: bool = False,
        gpu_field: str = "gpus",
    ) -> Profile:
        """The profile a user may use, or a PolicyError that says why not.

        ``server_choice`` restricts ``gpus`` to the exact choices offered for a
        server; jobs may ask for any count up to the profile's largest choice.
        """
        if slug is None:
            profile = self.default_for(groups, admin=admin)
            if profile is None:
                raise PolicyError(
                    "no profile is open to your groups",
                    reason="no_profile",
                    field="profile",
                    fix="ask an admin to add you to a group",
                )
        else:
            profile = self.get(slug)
        if not profile.allows(groups, admin=admin):
            mine = ", ".join(sorted(groups)) or "no groups"
            raise PolicyError(
                f"profile '{profile.slug}' is restricted to groups {', '.join(profile.groups)}; you are in {mine}",
                reason="profile_not_allowed",
                field="profile",
                fix="ask an admin to add you to one of those groups, or choose another profile",
            )
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
            raise ValidationError(f"{gpu_field} must be a whole number >= 0", field=gpu_field)
        if server_choice and gpus not in profile.gpu_choices:
            raise PolicyError(
                f"profile '{profile.slug}' offers {', '.join(map(str, profile.gpu_choices))} GPUs, not {gpus}",
                reason="gpus_not_offered",
                field=gpu_field,
            )
        if gpus > profile.max_gpus:
            raise PolicyError(
                f"profile '{profile.slug}' allows at most {profile.max_gpus} GPUs, {gpus} asked",
                reason="too_many_gpus",
                field=gpu_field,
                fix=f"ask for {profile.max_gpus} or fewer",
            )
        return profile


def _check_requirements(path: Path, where: str) -> None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: requirements file {path} does not exist", fix="create it or fix the path"
        ) from None
    for number, line in enumerate(lines, 1):
        text = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not text:
            continue
        if text.startswith(("-r", "--requirement", "-c", "--constraint", "-e", "--editable")):
            raise ConfigError(
                f"{path}:{number}: '{text}' is not allowed in a governed environment",
                fix="list every package in this file, pinned with ==",
            )
        if text.startswith("--"):  # pip options such as --index-url
            continue
        if not PIN.match(text):
            raise ConfigError(
                f"{path}:{number}: '{text}' is not pinned",
                fix="governed environments pin every package with ==, e.g. numpy==2.1.3",
            )


def load_profiles(path: str | Path) -> ProfileSet:
    """Read and validate a profiles file; raise ConfigError naming file, line and fix."""
    path = Path(path)
    schema = yamlconfig.load_schema("danlu.hub", "profiles.schema.yaml")
    data, marks = yamlconfig.load_validated(path, schema)
    profiles = []
    seen: dict[str, int] = {}
    defaults = []
    for i, raw in enumerate(data["profiles"]):
        where = yamlconfig.line_of(marks, ("profiles", i, "slug"), str(path))
        slug = raw["slug"]
        if slug in seen:
            raise ConfigError(
                f"{where}: profiles[{i}].slug: '{slug}' is already used by profiles[{seen[slug]}]",
                fix="give every profile its own slug",
            )
        seen[slug] = i
        env = raw["environment"]
        if len(env) > 1 and set(env) not in ({"requirements", "image"}, {"current", "image"}):
            raise ConfigError(
                f"{yamlconfig.line_of(marks, ('profiles', i, 'environment'), str(path))}: "
                f"profiles[{i}].environment: choose one of current or requirements (image, for Kubernetes, "
                "may accompany either)"
            )
        req = None
        if "requirements" in env:
            req = (path.parent / env["requirements"]).resolve()
            at = yamlconfig.line_of(marks, ("profiles", i, "environment", "requirements"), str(path))
            if not req.is_relative_to(path.parent.resolve()):
                raise ConfigError(f"{at}: profiles[{i}].environment.requirements must stay inside {path.parent}")
            _check_requirements(req, at)
        resources = raw.get("resources", {})
        if raw.get("default"):
            defaults.append(slug)
        profiles.append(
            Profile(
                slug=slug,
                display_name=raw["display_name"],
                description=raw.get("description", ""),
                default=bool(raw.get("default")),
                environment=dict(env),
                cpu=resources.get("cpu"),
                memory=resources.get("memory"),
                gpu_choices=tuple(sorted(set(resources.get("gpus", [0])))),
                groups=tuple(raw.get("groups", [])),
                requirements_path=req,
                gpu_idle_timeout_seconds=raw.get("gpu_idle_timeout_seconds"),
            )
        )
    if len(defaults) > 1:
        raise ConfigError(f"{path}: profiles {', '.join(defaults)} are all marked default", fix="mark only one")
    return ProfileSet(tuple(profiles), source=str(path))


def builtin_profiles() -> ProfileSet:
    """Used when no profiles file exists: one profile on the workbench's own Python."""
    return ProfileSet(
        (
            Profile(
                slug="python",
                display_name="Python (workbench environment)",
                description="The Python environment Danlu runs in.",
                default=True,
                environment={"current": True},
                gpu_choices=(0,),
            ),
        ),
        source="(built in)",
    )
