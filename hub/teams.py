"""What danlu.yaml's teams are measured in: sizes like ``8G``, and the queue that holds everything without teams.

A leaf with no imports of its own, so that the admission model (pure: no I/O) and the rendering of teams as
Kueue objects (:mod:`danlu.hub.kueue`) read teams the same way.
"""

from __future__ import annotations

#: the one queue, holding the whole machine, of a workbench with no teams
DEFAULT_QUEUE = "default"
_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value) -> float:
    """Bytes in ``512M``, ``8G``, ``1.5T`` (binary units; ``Gi`` is accepted too) or a plain number."""
    try:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().removesuffix("i").removesuffix("B")
        unit = text[-1:].upper() if text[-1:].isalpha() else ""
        return float(text[:-1] if unit else text) * _SIZE[unit]
    except OverflowError:  # an integer beyond a double's range
        raise ValueError(f"{str(value)[:40]} is too large for a size") from None
