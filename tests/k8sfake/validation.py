"""The API server's own validation of pods, which no schema states (``pkg/apis/core/validation``).

The official schemas say what a field's type is; the API server also refuses, with 422 ``Invalid``, a pod
whose volumes share a name, whose container mounts two volumes at one path, mounts a volume that does not
exist, has two containers of one name, or has a resource quantity that does not parse or a request above
its limit. That is how issue 16's fault 3 (two volumes at ``/dev/shm``) showed on a real cluster and not
here. :func:`pod_errors` returns ``(field, reason, message)`` in the API server's words;
:func:`invalid` makes the ``Status`` it answers with: ``Pod "x" is invalid: <field>: <detail>`` (several in
``[...]``), with one cause per error.
"""

from __future__ import annotations

from ..k8sschemas import parse_quantity
from .store import ApiError

QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


def _quantity(value) -> object | None:
    try:
        return parse_quantity(str(value))
    except (ValueError, TypeError, ArithmeticError):
        return None


def pod_spec_errors(spec: dict, path: str = "spec") -> list[tuple[str, str, str]]:
    errors = []
    volumes = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        name = volume.get("name")
        if name in volumes:
            errors.append((f"{path}.volumes[{i}].name", "FieldValueDuplicate", f'Duplicate value: "{name}"'))
        volumes.add(name)
    containers = set()
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            where = f"{path}.{kind}[{i}]"
            if container.get("name") in containers:
                errors.append((f"{where}.name", "FieldValueDuplicate", f'Duplicate value: "{container.get("name")}"'))
            containers.add(container.get("name"))
            paths = set()
            for j, mount in enumerate(container.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    errors.append(
                        (f"{where}.volumeMounts[{j}].name", "FieldValueNotFound", f'Not found: "{mount.get("name")}"')
                    )
                if mount.get("mountPath") in paths:
                    errors.append(
                        (
                            f"{where}.volumeMounts[{j}].mountPath",
                            "FieldValueInvalid",
                            f'Invalid value: "{mount.get("mountPath")}": must be unique',
                        )
                    )
                paths.add(mount.get("mountPath"))
            resources = container.get("resources") or {}
            parsed = {}
            for section in ("limits", "requests"):
                for resource, value in (resources.get(section) or {}).items():
                    quantity = _quantity(value)
                    if quantity is None:
                        errors.append(
                            (
                                f"{where}.resources.{section}[{resource}]",
                                "FieldValueInvalid",
                                f'Invalid value: "{value}": quantities must match the regular expression '
                                f"'{QUANTITY}'",
                            )
                        )
                    else:
                        parsed[(section, resource)] = quantity
            for (section, resource), request in parsed.items():
                limit = parsed.get(("limits", resource))
                if section == "requests" and limit is not None and request > limit:
                    value = resources["requests"][resource]
                    errors.append(
                        (
                            f"{where}.resources.requests",
                            "FieldValueInvalid",
                            f'Invalid value: "{value}": must be less than or equal to {resource} limit of '
                            f"{resources['limits'][resource]}",
                        )
                    )
    return errors


def errors_of(obj: dict) -> list[tuple[str, str, str]]:
    """What the API server refuses in ``obj`` beyond its schema (pods, and the pod templates of Jobs)."""
    if obj.get("kind") == "Pod":
        return pod_spec_errors(obj.get("spec") or {})
    if obj.get("kind") == "Job":
        return pod_spec_errors(((obj.get("spec") or {}).get("template") or {}).get("spec") or {}, "spec.template.spec")
    return []


def invalid(obj: dict, errors: list[tuple[str, str, str]], group: str = "") -> ApiError:
    kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name")
    details = [f"{field}: {message}" for field, _, message in errors]
    text = details[0] if len(details) == 1 else "[" + ", ".join(details) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{kind}{"." + group if group else ""} "{name}" is invalid: {text}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": reason, "message": message, "field": field} for field, reason, message in errors],
        },
    )
