"""Pure tests of danlu.yaml's options as traits: help and defaults, the schema generated from them,
the errors an admin sees, ``danlu config``, and the admin guide's reference.

:mod:`danlu.hub.config` declares every option once, as a trait; everything else (the JSON
Schema the file is validated with, ``danlu config``, the cluster's danlu.yaml) is derived from
those traits, so these tests check the derivations and that the docs keep up.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from traitlets import Bool, Enum, Float, Integer, Unicode

from danlu.errors import ConfigError
from danlu.hub import cli
from danlu.hub.config import Settings, load_settings, schema, secret_options
from danlu.hub.traits import options

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "admin-guide.md"


def write_config(tmp_path, text: str) -> Path:
    path = tmp_path / "danlu.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def refused(path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    return info.value


def every_option() -> list[tuple[tuple[str, ...], object]]:
    """(key path, trait) of every option, top level first."""
    return [
        ((*node.key_path, name), trait) for node in Settings().walk() for name, trait in options(type(node)).items()
    ]


# the options themselves ---------------------------------------------------------------------------------------


def test_every_option_has_help_and_a_default():
    settings = Settings()
    assert len(every_option()) > 70
    for node in settings.walk():
        for name, trait in options(type(node)).items():
            key = ".".join((*node.key_path, name))
            assert len(trait.help.split()) >= 4, f"{key} needs a help text that says what it does"
            assert trait.metadata.get("config") is True, key
            getattr(node, name)  # the default is a valid value (it is validated on first read)


def test_reads_are_copies_so_no_reader_changes_the_configuration():
    settings = Settings.from_data({"teams": {"vision": {"quota": {"gpus": {"sim": 1}}}}})

    settings.teams["vision"]["quota"] = {}

    assert settings.teams == {"vision": {"quota": {"gpus": {"sim": 1}}}}


# the generated schema ----------------------------------------------------------------------------------------


def _objects(node, path=()):
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            yield path, node
        for key, value in node.items():
            yield from _objects(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _objects(value, (*path, i))


def test_the_schema_is_the_options_and_refuses_any_other_key():
    generated = schema()
    jsonschema.Draft202012Validator.check_schema(generated)
    for path, obj in _objects(generated):
        assert obj.get("additionalProperties") is False, f"{'/'.join(map(str, path))} allows other keys"
    for key, trait in every_option():
        node = generated
        for part in key:
            node = node["properties"][part]
        assert node["description"] == " ".join(trait.help.split())


def _example_files() -> list[Path]:
    return sorted((ROOT / "examples" / "config").glob("*.yaml"))


def _cluster_files() -> list[tuple[str, str]]:
    """The danlu.yaml of each committed cluster rendering (in its ConfigMap)."""
    out = []
    for path in sorted((ROOT / "helm-values").glob("*/mlflow.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            if obj and obj.get("kind") == "ConfigMap" and "danlu.yaml" in obj.get("data", {}):
                out.append((str(path.relative_to(ROOT)), obj["data"]["danlu.yaml"]))
    return out


def _guide_files() -> list[tuple[str, str]]:
    """The admin guide's complete danlu.yaml (the block under 'A complete file')."""
    text = GUIDE.read_text()
    block = text[text.index("### A complete file") :]
    return [("docs/admin-guide.md", re.search(r"```yaml\n(.*?)```", block, re.S).group(1))]


def test_the_examples_and_the_rendered_files_load(tmp_path):
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in _example_files()] + _cluster_files() + _guide_files()
    assert len(texts) >= 5
    validator = jsonschema.Draft202012Validator(schema())
    for name, text in texts:
        data = yaml.safe_load(text)
        assert not list(validator.iter_errors(data)), name
        path = tmp_path / "danlu.yaml"
        path.write_text(text)
        settings = load_settings(path, environ={"DANLU_BASE_DIR": str(ROOT)})
        assert settings.explicit() == data, name  # what was given, and nothing else, is kept as given


def test_explicit_options_load_back_to_the_same_settings():
    def values(settings):
        return {(*node.key_path, name): getattr(node, name) for node in settings.walk() for name in options(type(node))}

    for path in _example_files():
        settings = load_settings(path, environ={})
        assert values(Settings.from_data(settings.explicit())) == values(settings)


# errors ------------------------------------------------------------------------------------------------------


def test_an_unknown_key_names_the_nearest_valid_one_and_the_keys_of_its_section(tmp_path):
    path = write_config(
        tmp_path,
        """
        port: 8000
        jobs:
          warm_runners: 1
          max_runtime: 3600
    """,
    )

    error = refused(path)

    assert str(error).startswith(f"{path}:4: jobs.max_runtime: unknown key, did you mean 'max_runtime_seconds'?")
    assert error.fix.startswith("the keys of jobs are backend, database_url,") and "warm_runners_per_user" in error.fix


@pytest.mark.parametrize(
    "text, line, key, nearest",
    [
        ("job:\n  max_nproc: 2\n", 1, "job", "jobs"),
        ("kubernetes:\n  mlflow:\n    imag: x\n", 3, "kubernetes.mlflow.imag", "image"),
        ("auth:\n  type: pam\n  allowed_user: [a]\n", 3, "auth.allowed_user", "allowed_users"),
        ("teams:\n  vision:\n    quota: {gpus: {sim: 1}}\n    cohrt: shared\n", 4, "teams.vision.cohrt", "cohort"),
    ],
)
def test_a_mistyped_key_anywhere_gets_file_line_and_nearest_name(tmp_path, text, line, key, nearest):
    path = tmp_path / "danlu.yaml"
    path.write_text(text)

    assert str(refused(path)).startswith(f"{path}:{line}: {key}: unknown key, did you mean '{nearest}'?")


@pytest.mark.parametrize(
    "text, line, key, expected",
    [
        ("jobs:\n  max_nproc: many\n", 2, "jobs.max_nproc", "use an integer"),
        ("usage:\n  gpu_hour_cost: {sim: cheap}\n", 2, "usage.gpu_hour_cost.sim", "use a number"),
        ("gpus:\n  detect: 2\n", 2, "gpus.detect", "use a boolean"),
        ("admin_users: alice\n", 1, "admin_users", "use an array"),
    ],
)
def test_a_mistyped_value_names_the_key_and_the_type_expected(tmp_path, text, line, key, expected):
    path = tmp_path / "danlu.yaml"
    path.write_text(text)

    error = refused(path)

    assert str(error).startswith(f"{path}:{line}: {key}: ") and "is not of type" in str(error)
    assert error.fix == expected


def test_the_backend_is_an_installed_one_or_an_import_string(tmp_path):
    path = write_config(tmp_path, "jobs:\n  backend: kubernets\n")
    error = refused(path)
    assert str(error).startswith(f"{path}:2: jobs.backend: unknown backend 'kubernets', did you mean 'kubernetes'?")
    assert "local" in error.fix

    path.write_text("jobs:\n  backend: danlu.hub.backends.local:LocalBackend\n")
    assert load_settings(path, environ={}).jobs.backend == "danlu.hub.backends.local:LocalBackend"
    path.write_text("jobs:\n  backend: no_such_package.backend:Backend\n")
    assert "there is no module no_such_package.backend" in str(refused(path))


def test_flags_are_checked_like_the_file():
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"jobs": {"max_nprc": 2}}, environ={})
    assert str(info.value).startswith("the command line: jobs.max_nprc: unknown key, did you mean 'max_nproc'?")


# where values come from ----------------------------------------------------------------------------------------


def test_origins_say_file_environment_flag_or_default(tmp_path):
    path = write_config(tmp_path, "ip: 10.0.0.1\njobs:\n  max_nproc: 2\n")

    settings = load_settings(path, {"state_dir": str(tmp_path)}, environ={"DANLU_PORT": "8100"})

    assert settings.origin("ip") == ("file", f"{path}:1")
    assert settings.origin("jobs", "max_nproc") == ("file", f"{path}:3")
    assert settings.origin("port") == ("environment", "DANLU_PORT")
    assert settings.origin("state_dir") == ("flag", "--state-dir")
    assert settings.origin("jobs", "backend") == ("default", "")
    assert settings.is_set("jobs") and settings.is_set("jobs", "max_nproc") and not settings.is_set("auth")
    assert settings.explicit() == {"ip": "10.0.0.1", "port": 8100, "state_dir": str(tmp_path), "jobs": {"max_nproc": 2}}


# danlu config -----------------------------------------------------------------------------------------------

SECRETS = {"client_secret": "oauth-client-s3cret", "db_password": "pg-pa55word"}


def test_danlu_config_shows_every_option_with_its_help_default_and_origin(tmp_path, capsys):
    path = write_config(tmp_path, "jobs:\n  max_nproc: 8\n")

    assert cli.main(["config", "--config", str(path)]) == 0
    out = capsys.readouterr().out

    for key, trait in every_option():
        assert f"\n{'.'.join(key)} = " in out, key
        assert " ".join(trait.help.split())[:60] in " ".join(out.split()), key
    assert f"jobs.max_nproc = 8  [{path}:2]\n    integer >= 1; default 64\n" in out
    assert 'jobs.backend = "local"  [default]' in out


def test_danlu_config_json_has_one_entry_per_option(tmp_path, capsys):
    path = write_config(tmp_path, "port: 8100\n")

    assert cli.main(["config", "--config", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)

    assert [tuple(row["key"].split(".")) for row in rows] == [key for key, _ in every_option()]
    port = next(row for row in rows if row["key"] == "port")
    assert port == {
        "key": "port",
        "section": "",
        "class": "Settings",
        "type": "integer, 1-65535",
        "default": 8000,
        "value": 8100,
        "source": "file",
        "where": f"{path}:1",
        "help": port["help"],
    }


def test_danlu_config_never_shows_a_secret(tmp_path, capsys):
    path = write_config(
        tmp_path,
        f"""
        auth:
          type: github
          client_id: workbench
          client_secret: {SECRETS["client_secret"]}
          oauth_callback_url: https://wb.example.org/hub/oauth_callback
          options: {{token_secret: x-{SECRETS["db_password"]}}}
        jobs:
          database_url: postgresql+psycopg://danlu:{SECRETS["db_password"]}@db:5432/danlu
    """,
    )

    assert cli.main(["config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert cli.main(["config", "--config", str(path), "--json"]) == 0
    out += capsys.readouterr().out

    assert not [secret for secret in SECRETS.values() if secret in out]
    assert 'auth.client_secret = "(set)"' in out and 'auth.user_password = "(not set)"' in out
    assert "postgresql+psycopg://danlu:***@db:5432/danlu" in out
    assert {".".join(path) for path in secret_options()} == {
        "auth.client_secret",
        "auth.user_password",
        "auth.admin_password",
    }


def test_danlu_config_names_a_bad_file_in_one_line(tmp_path, capsys):
    path = write_config(tmp_path, "jobs:\n  max_runtime: 3600\n")

    assert cli.main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"danlu: {path}:2: jobs.max_runtime: unknown key, did you mean 'max_runtime_seconds'?")
    assert "Traceback" not in err


# the admin guide --------------------------------------------------------------------------------------------


def _chunks(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each heading of a markdown text (code blocks left out: their ``#`` are comments)."""
    parts = re.split(r"^(#+ .*)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _mentions(chunks, key: tuple[str, ...]) -> bool:
    """Whether the guide names the option: `jobs.max_nproc` anywhere, or `max_nproc` under a heading naming `jobs`
    (`mlflow.image` under one naming `kubernetes`), or a top-level option under 'Top level'."""
    for heading, body in chunks:
        if f"`{'.'.join(key)}`" in body:
            return True
        for k in range(len(key)):
            owner, rest = ".".join(key[:k]), ".".join(key[k:])
            if (f"`{owner}`" in heading if owner else "Top level" in heading) and (
                f"`{rest}`" in body or f"`{rest}`," in body
            ):
                return True
    return False


def test_the_admin_guide_names_every_option():
    chunks = _chunks(GUIDE.read_text())
    missing = [".".join(key) for key, _ in every_option() if not _mentions(chunks, key)]
    assert not missing, f"docs/admin-guide.md's danlu.yaml reference does not mention: {', '.join(missing)}"
    assert "danlu config" in GUIDE.read_text()


def test_the_admin_guides_defaults_are_the_options_defaults():
    """In the reference tables (| Key | Type | Default | Meaning |), a default written as one literal is the trait's."""
    chunks = _chunks(GUIDE.read_text())
    checked = 0
    for key, trait in every_option():
        expected = trait.metadata.get("default_text", trait.default())
        if not isinstance(trait, (Integer, Float, Bool, Enum, Unicode)) or expected is None:
            continue
        for k in range(len(key)):
            owner, rest = ".".join(key[:k]), ".".join(key[k:])
            for heading, body in chunks:
                if not (f"`{owner}`" in heading if owner else "Top level" in heading):
                    continue
                for cell in re.findall(rf"^\| `{re.escape(rest)}` \|[^|]*\| `([^`]*)`[^|]*\|", body, re.M):
                    assert yaml.safe_load(cell) == expected, f"{'.'.join(key)}: the guide says {cell}"
                    checked += 1
    assert checked >= 25
