"""Pure tests of danlu.yaml loading: defaults, precedence and line-accurate errors.

Covers :func:`danlu.hub.config.load_settings` and the YAML helpers of
:mod:`danlu.hub.yamlconfig` it is built on. Every error test checks that the
message names the file, the line and the key, because that is what lets an
admin fix a file without reading code.
"""

from __future__ import annotations

import textwrap

import pytest

from danlu.errors import ConfigError
from danlu.hub import yamlconfig
from danlu.hub.config import load_settings
from danlu.hub.options import JobsConfig


def write_config(tmp_path, text: str):
    path = tmp_path / "danlu.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def config_error(path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={}, **kwargs)
    return str(info.value)


# valid files and defaults ------------------------------------------------------------


def test_valid_file_is_read(tmp_path):
    path = write_config(
        tmp_path,
        """
        ip: 0.0.0.0
        port: 8100
        public_url: https://wb.example.org/
        admin_users: [admin]
        groups:
          vision: [carol]
        jobs:
          max_nproc: 8
        datasets:
          roots:
            shared: /data/shared
    """,
    )

    settings = load_settings(path, environ={})

    assert settings.ip == "0.0.0.0"
    assert settings.port == 8100
    assert settings.local_url == "http://127.0.0.1:8100"
    assert settings.public_url == "https://wb.example.org"
    assert settings.admin_users == ["admin"]
    assert settings.groups == {"vision": ["carol"]}
    assert settings.jobs.max_nproc == 8
    assert settings.jobs.warm_runners == JobsConfig.warm_runners.default_value == 1
    assert str(settings.dataset_roots["shared"]) == "/data/shared"
    assert settings.source == str(path)


def test_no_file_gives_defaults(tmp_path):
    settings = load_settings(None, environ={"DANLU_BASE_DIR": str(tmp_path)})

    assert settings.source is None
    assert settings.ip == "127.0.0.1"
    assert settings.port == 8000
    assert settings.auth.type == "pam"
    assert settings.explicit() == {}
    assert all(
        getattr(settings.jobs, name) == trait.default() for name, trait in JobsConfig.class_traits(config=True).items()
    )
    assert settings.state_dir == (tmp_path / ".danlu").resolve()
    assert settings.profiles_file == tmp_path / "kernel-images" / "profiles.yaml"
    assert settings.jobs_database_url == f"sqlite:///{tmp_path.resolve() / '.danlu' / 'danlu.sqlite'}"


def test_empty_file_gives_defaults(tmp_path):
    path = write_config(tmp_path, "# nothing configured yet\n")

    settings = load_settings(path, environ={})

    assert settings.explicit() == {}
    assert settings.port == 8000


def test_config_file_taken_from_danlu_config(tmp_path):
    path = write_config(tmp_path, "port: 8123\n")

    settings = load_settings(None, environ={"DANLU_CONFIG": str(path)})

    assert settings.port == 8123
    assert settings.source == str(path)


def test_relative_paths_resolve_against_base_dir(tmp_path):
    path = write_config(tmp_path, "state_dir: state\nprofiles_file: conf/profiles.yaml\n")
    base = tmp_path / "run-here"

    settings = load_settings(path, environ={"DANLU_BASE_DIR": str(base)})

    assert settings.state_dir == (base / "state").resolve()
    assert settings.profiles_file == base / "conf" / "profiles.yaml"
    assert settings.jobs_dir == (base / "state").resolve() / "jobs"


# precedence: flag > environment > file > default -------------------------------------


def test_environment_overrides_file(tmp_path):
    path = write_config(tmp_path, "ip: 10.0.0.1\nport: 8100\nstate_dir: from-file\n")
    environ = {"DANLU_IP": "10.0.0.2", "DANLU_PORT": "8200", "DANLU_STATE_DIR": str(tmp_path / "from-env")}

    settings = load_settings(path, environ=environ)

    assert settings.ip == "10.0.0.2"
    assert settings.port == 8200
    assert settings.state_dir == (tmp_path / "from-env").resolve()


def test_empty_environment_variable_is_ignored(tmp_path):
    path = write_config(tmp_path, "port: 8100\n")

    assert load_settings(path, environ={"DANLU_PORT": ""}).port == 8100


def test_explicit_overrides_beat_environment(tmp_path):
    path = write_config(tmp_path, "port: 8100\n")

    settings = load_settings(
        path, {"port": 8300, "ip": "10.0.0.3"}, environ={"DANLU_PORT": "8200", "DANLU_IP": "10.0.0.2"}
    )

    assert settings.port == 8300
    assert settings.ip == "10.0.0.3"


def test_none_override_leaves_environment_value(tmp_path):
    settings = load_settings(None, {"port": None}, environ={"DANLU_PORT": "8200"})

    assert settings.port == 8200


def test_non_numeric_port_in_environment_is_refused():
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={"DANLU_PORT": "http"})

    assert str(info.value) == "DANLU_PORT: port must be a number, got 'http'"


def test_out_of_range_port_flag_is_refused():
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"port": 70000}, environ={})

    assert "--port: port 70000 is out of range" in str(info.value)
    assert "1-65535" in str(info.value)


# bad files -------------------------------------------------------------------------


def test_unknown_key_names_file_line_key_and_suggestion(tmp_path):
    path = write_config(
        tmp_path,
        """
        ip: 127.0.0.1
        prot: 8100
    """,
    )

    message = config_error(path)

    assert message.startswith(f"{path}:2: prot: unknown key")
    assert "did you mean 'port'?" in message


def test_unknown_nested_key_gives_its_own_line(tmp_path):
    path = write_config(
        tmp_path,
        """
        jobs:
          warm_runners: 1
          max_nprc: 4
    """,
    )

    message = config_error(path)

    assert message.startswith(f"{path}:3: jobs.max_nprc: unknown key")
    assert "did you mean 'max_nproc'?" in message


def test_wrong_type_names_line_and_type(tmp_path):
    path = write_config(
        tmp_path,
        """
        ip: 127.0.0.1
        port: eighty
    """,
    )

    message = config_error(path)

    assert message.startswith(f"{path}:2: port: 'eighty' is not of type 'integer'")


@pytest.mark.parametrize("port", [0, 70000])
def test_port_outside_range_is_refused(tmp_path, port):
    path = write_config(tmp_path, f"port: {port}\n")

    message = config_error(path)

    assert message.startswith(f"{path}:1: port: {port}")
    assert "allowed range" in message


def test_bad_list_item_points_at_its_line(tmp_path):
    path = write_config(
        tmp_path,
        """
        admin_users:
          - admin
          - Not A User
    """,
    )

    message = config_error(path)

    assert message.startswith(f"{path}:3: admin_users[1]:")


def test_invalid_yaml_names_the_line(tmp_path):
    path = write_config(
        tmp_path,
        """
        ip: 127.0.0.1
        jobs: 1
          max_nproc: 2
    """,
    )

    message = config_error(path)

    assert message.startswith(f"{path}:3: not valid YAML:")
    assert "indentation" in message


def test_oidc_auth_missing_required_keys(tmp_path):
    path = write_config(
        tmp_path,
        """
        port: 8000
        auth:
          type: oidc
          client_id: workbench
          client_secret: s3cret
          oauth_callback_url: https://wb.example.org/hub/oauth_callback
    """,
    )

    message = config_error(path)

    # the issuer alone is enough (discovery); the three endpoints are the alternative
    assert message.startswith(f"{path}:2: auth: 'issuer' is a required property"), message


def test_oidc_auth_with_every_key_loads(tmp_path):
    path = write_config(
        tmp_path,
        """
        auth:
          type: oidc
          client_id: workbench
          client_secret: s3cret
          oauth_callback_url: https://wb.example.org/hub/oauth_callback
          authorize_url: https://idp.example.org/authorize
          token_url: https://idp.example.org/token
          userdata_url: https://idp.example.org/userinfo
    """,
    )

    assert load_settings(path, environ={}).auth.type == "oidc"


def test_missing_file_is_named(tmp_path):
    message = config_error(tmp_path / "absent.yaml")

    assert message.startswith(f"{tmp_path / 'absent.yaml'}: file not found")


# yamlconfig helpers ----------------------------------------------------------------


def test_marks_record_line_of_every_key_and_item():
    data, marks = yamlconfig.parse_with_marks("a:\n  b: 1\n  c:\n    - x\n    - y\n", "f.yaml")

    assert data == {"a": {"b": 1, "c": ["x", "y"]}}
    assert marks[("a",)] == 1
    assert marks[("a", "b")] == 2
    assert marks[("a", "c", 1)] == 5


def test_line_of_falls_back_to_nearest_parent():
    _, marks = yamlconfig.parse_with_marks("jobs:\n  max_nproc: 2\n", "danlu.yaml")

    assert yamlconfig.line_of(marks, ("jobs", "warm_runners"), "danlu.yaml") == "danlu.yaml:1"
    assert yamlconfig.line_of(marks, ("other",), "danlu.yaml") == "danlu.yaml:1"  # the document itself
    assert yamlconfig.line_of({}, ("other",), "danlu.yaml") == "danlu.yaml"


def test_settings_where_uses_the_source_file(tmp_path):
    path = write_config(tmp_path, "port: 8000\njobs:\n  max_nproc: 2\n")

    settings = load_settings(path, environ={})

    assert settings.where("jobs", "max_nproc") == f"{path}:3"
