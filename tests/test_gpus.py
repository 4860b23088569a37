"""Pure tests of the GPU inventory (danlu.hub.gpus)."""

from danlu.hub import gpus
from danlu.hub.config import Settings


def test_flavor_names():
    assert gpus.flavor_of("NVIDIA H200") == "h200"
    assert gpus.flavor_of("Tesla V100-SXM2-32GB") == "v100-sxm2-32gb"
    assert gpus.flavor_of("NVIDIA GeForce RTX 4090") == "geforce"
    assert gpus.flavor_of("") == "gpu"


def test_parse_nvidia_smi():
    out = "0, NVIDIA H200, GPU-aaa, 143771\n1, NVIDIA H200, GPU-bbb, 143771\n"
    found = gpus.parse_nvidia_smi(out)
    assert [(g.index, g.flavor, g.uuid) for g in found] == [(0, "h200", "GPU-aaa"), (1, "h200", "GPU-bbb")]
    assert found[0].memory_gib == 140.4


def test_declared_groups_are_numbered_in_order():
    declared = [{"count": 2, "flavor": "a100"}, {"count": 1, "flavor": "sim"}]
    settings = Settings.from_data({"gpus": {"declared": declared}})
    inventory = gpus.inventory(settings.gpus)
    assert [(g.index, g.flavor, g.declared) for g in inventory] == [
        (0, "a100", True),
        (1, "a100", True),
        (2, "sim", True),
    ]


def test_detection_can_be_turned_off():
    assert gpus.inventory(Settings.from_data({"gpus": {"detect": False}}).gpus) == []
