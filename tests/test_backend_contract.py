"""Pure tests of the backend contract, enforced when a subclass is defined, and of the registry."""

from __future__ import annotations

import pytest

from danlu.errors import ConfigError
from danlu.hub.backends import Registry, backends
from danlu.hub.backends.base import Backend


def test_complete_backend_can_be_defined():
    class CompleteBackend(Backend):
        async def start(self, job):
            return {}

        async def poll(self, job_id, state):
            return None

        async def cancel(self, job_id, state, grace):
            return None

        async def read_log(self, job_id, state, offset, limit):
            return b"", 0

        async def read_output(self, job_id, state, rank, offset, limit):
            return None

    assert issubclass(CompleteBackend, Backend)


def test_missing_methods_are_named_at_class_definition():
    with pytest.raises(TypeError) as info:

        class StartOnlyBackend(Backend):
            async def start(self, job):
                return {}

    assert str(info.value) == (
        "StartOnlyBackend must implement poll, cancel, read_log, read_output to be a Danlu backend"
    )


def test_empty_backend_names_every_required_method():
    with pytest.raises(TypeError, match="EmptyBackend must implement start, poll, cancel, read_log, read_output"):

        class EmptyBackend(Backend):
            pass


async def coroutine_method(self, *args):
    return None


def plain_method(self, *args):
    return None


def test_blocking_start_is_refused_at_class_definition():
    with pytest.raises(TypeError) as info:

        class BlockingBackend(Backend):
            def start(self, job):
                return {}

            poll = cancel = read_log = read_output = coroutine_method

    assert str(info.value) == "BlockingBackend.start must be async"


@pytest.mark.parametrize("method", ["poll", "cancel", "wait", "cleanup", "read_log", "read_output"])
def test_other_lifecycle_methods_must_be_async(method):
    namespace = {
        "start": coroutine_method,
        "poll": coroutine_method,
        "cancel": coroutine_method,
        "read_log": coroutine_method,
        "read_output": coroutine_method,
        method: plain_method,
    }

    with pytest.raises(TypeError) as info:
        type("BlockingBackend", (Backend,), namespace)

    assert str(info.value) == f"BlockingBackend.{method} must be async"


def test_subclass_of_a_complete_backend_inherits_the_contract():
    from danlu.hub.backends.local import LocalBackend

    class QuietLocalBackend(LocalBackend):
        name = "quiet-local"

    assert QuietLocalBackend.start is LocalBackend.start


def test_local_backend_is_registered():
    from danlu.hub.backends.local import LocalBackend

    assert backends.get("local") is LocalBackend
    assert "local" in backends.names()


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ConfigError) as info:
        backends.get("nope")

    assert info.value.reason == "unknown_backend"
    assert str(info.value).startswith("unknown backend 'nope' (choose one of: ")
    assert "local" in info.value.fix.split(": ", 1)[1].split(", ")


def test_registry_imports_a_registered_string_on_first_use():
    registry = Registry("danlu.test-nothing-here", "store")
    registry.register("ordered", "collections:OrderedDict")

    from collections import OrderedDict

    assert registry.get("ordered") is OrderedDict
    assert registry.names() == ["ordered"]
    with pytest.raises(ConfigError, match="unknown store 'x' \\(choose one of: ordered\\)"):
        registry.get("x")
