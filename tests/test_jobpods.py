"""Pure tests of :mod:`danlu.hub.backends.jobpods`: rank 0 among JobSet's pods, what pods wait for, and how
each reason of Kueue v0.19's ``Evicted`` condition ends an attempt (issue 16, faults 7 and 8)."""

from __future__ import annotations

import pytest

from danlu.hub.backends import jobpods


def pod(name, replicated="node", job="0", index="0", **status):
    labels = {
        jobpods.JOBSET_NAME: "t",
        jobpods.REPLICATED_JOB: replicated,
        jobpods.JOB_INDEX: job,
        jobpods.COMPLETION_INDEX: index,
    }
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def test_rank_0_is_completion_index_0_of_job_0_of_node_not_the_first_name():
    pods = [
        pod("t-node-0-1-aaaaa", index="1"),
        pod("t-init-0-0-aaaaa", replicated="dataset-initializer"),
        pod("t-node-0-0-zzzzz"),
    ]
    assert [p["metadata"]["name"] for p in sorted(pods, key=jobpods.rank_order)][0] == "t-node-0-0-zzzzz"


def test_what_pods_wait_for_in_the_kubelets_and_the_schedulers_words():
    pulling = pod(
        "a",
        container_statuses=[
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}}}
        ],
    )
    unschedulable = pod(
        "b", conditions=[{"type": "PodScheduled", "status": "False", "message": "0/3 nodes are available"}]
    )
    creating = pod("c", containerStatuses=[{"state": {"waiting": {"reason": "ContainerCreating"}}}])
    assert jobpods.waiting_for([pulling, unschedulable, creating]) == (
        'ImagePullBackOff: Back-off pulling image "x"; not scheduled: 0/3 nodes are available'
    )


@pytest.mark.parametrize(
    "reason, state, infrastructure, interrupted",
    [
        ("Preempted", "preempted", False, True),
        ("PodsReadyTimeout", "failed", True, False),
        ("Deactivated", "cancelled", False, False),
        ("ClusterQueueStopped", "failed", True, True),
        ("NodeFailures", "failed", True, True),
    ],
)
def test_only_a_preemption_is_one(reason, state, infrastructure, interrupted):
    """Before issue 16 every Evicted reason was read as a preemption."""
    outcome = jobpods.eviction_outcome({"reason": reason, "message": "m"}, "ErrImagePull: no", 600)
    assert (outcome.state, outcome.infrastructure, outcome.interrupted, outcome.authoritative) == (
        state,
        infrastructure,
        interrupted,
        True,
    )
    if reason == "PodsReadyTimeout":
        assert outcome.reason.startswith("its pods were not ready in 600 s") and outcome.reason.endswith(
            "ErrImagePull: no"
        )
