"""Pure tests of the job state machine: :func:`danlu.hub.service.states.transition`."""

from __future__ import annotations

import pytest

from danlu.errors import Conflict
from danlu.hub.service.states import FINAL, TRANSITIONS, JobState, transition

ALLOWED = [
    ("queued", "running"),
    ("queued", "cancelled"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("running", "queued"),
    ("running", "preempted"),
    ("running", "timed_out"),
    ("preempted", "queued"),
    ("preempted", "cancelled"),
    ("preempted", "succeeded"),
]


@pytest.mark.parametrize("current, new", ALLOWED)
def test_allowed_transitions(current, new):
    assert transition(current, new) is JobState(new)


def test_the_table_lists_exactly_the_documented_transitions():
    table = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}

    assert table == set(ALLOWED)


def test_accepts_enum_members():
    assert transition(JobState.queued, JobState.running) is JobState.running


@pytest.mark.parametrize(
    "current, new",
    [
        ("queued", "succeeded"),
        ("queued", "failed"),
        ("queued", "queued"),
        ("running", "running"),
    ],
)
def test_forbidden_transitions_from_live_states(current, new):
    with pytest.raises(Conflict) as info:
        transition(current, new)

    assert info.value.reason == "bad_transition"
    assert info.value.status == 409
    assert str(info.value) == f"a {current} job cannot become {new}"


@pytest.mark.parametrize("current", ["succeeded", "failed", "cancelled"])
@pytest.mark.parametrize("new", [state.value for state in JobState])
def test_nothing_leaves_a_final_state(current, new):
    with pytest.raises(Conflict) as info:
        transition(current, new)

    assert info.value.reason == "already_final"
    assert str(info.value) == f"the job already ended ({current})"


def test_final_states():
    assert (
        {state for state in JobState if state.final}
        == FINAL
        == {JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timed_out}
    )
    assert JobState.running == "running"  # a str Enum: compares equal to its database value


def test_unknown_state_is_refused():
    with pytest.raises(ValueError):
        transition("queued", "paused")
