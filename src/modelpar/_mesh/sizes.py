"""What a mesh size argument may be, checked where it is given (the strategies' options, the memory estimate).

Each axis's size is checked alone here, before any layout is resolved, so a wrong type or a non-positive value is
refused by name at construction; how the sizes fit the world size together is :mod:`modelpar._mesh.layout`'s.
"""

from __future__ import annotations

from typing import Literal

from modelpar._errors import MeshSizeError

__all__ = [
    "SizeArg",
    "check_context_parallel_size",
    "check_expert_parallel_size",
    "check_pipeline_parallel_size",
    "check_size_arg",
]

SizeArg = Literal["auto"] | int


def check_size_arg(name: str, value: object) -> None:
    """Reject anything but a positive int or ``"auto"`` (``bool`` is an ``int`` to Python, not to us).

    :class:`MeshSizeError` (a ``ValueError``): Lightning's strategy does not check them and mostly fails
    later, in its product check, with the ``RuntimeError`` the class derives from as well.
    """
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshSizeError(
            f"`{name}={value!r}` is not a valid size. Pass a positive integer (the number of processes"
            f' along the {name.replace("_size", "").replace("_", "-")} axis) or "auto".'
        )


def _positive_size(name: str, value: object, meaning: str) -> int:
    """``value`` if it is a positive int, else a :class:`MeshSizeError` saying what the size counts (``meaning``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshSizeError(f"`{name}={value!r}` is not a valid size. Pass a positive integer: {meaning}.")
    return value


def check_context_parallel_size(value: object) -> int:
    """Reject anything but a positive int: the sequence split has no sensible ``"auto"`` (it depends on the length)."""
    return _positive_size(
        "context_parallel_size", value, "the number of ranks that split each sequence (1 turns context parallelism off)"
    )


def check_expert_parallel_size(value: object) -> int:
    """Reject anything but a positive int: how many ranks split the experts is a model decision, not ``"auto"``."""
    return _positive_size(
        "expert_parallel_size",
        value,
        "the number of ranks that split each MoE layer's experts (1 turns expert parallelism off)",
    )


def check_pipeline_parallel_size(value: object) -> int:
    """Reject anything but a positive int: how many stages to cut the model into is a model decision, not "auto"."""
    return _positive_size(
        "pipeline_parallel_size",
        value,
        "the number of ranks along the pipeline, each holding other stages of the model (1 turns pipeline"
        " parallelism off)",
    )
