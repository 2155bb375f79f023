"""The float8 all-gather's weight scales, computed once after each weight update, by the strategy.

Under the tensorwise recipe's float8 all-gather, FSDP2 casts each weight shard to float8 before gathering it, with
a scale that must be the whole weight's (``max(abs(w))`` over every shard). torchao computes all of them in one
all-reduce (``precompute_float8_dynamic_scale_for_fsdp``), which its users must call after every optimizer step:
a scale computed before the step is stale after it, and weights that grew past it saturate. Without a precomputed
scale, each weight's all-gather reduces its own (one all-reduce per layer).

Here nobody has to remember it: :func:`refresh_scales_before_forward` makes the model recompute the scales
before a forward when any float8 weight changed since the last time (a tensor's version counter moves with every
in-place write: the optimizer's step, a checkpoint load, a user's ``copy_``). It runs as a forward pre-hook placed
before FSDP2's own on the root and on every FSDP unit holding float8 weights, so it precedes the all-gathers, once
per update whoever calls the forward (Fabric, the Trainer's ``training_step``, a pipeline stage). Every rank holding
the weights sees the same updates, so all of them take part in the all-reduce, or none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from modelpar.float8._state import is_cast_wrapper

__all__ = ["ScaleRefresh", "refresh_scales", "refresh_scales_before_forward"]

_ATTRIBUTE = "_modelpar_float8_scales"


class ScaleRefresh:
    """Recomputes ``model``'s float8 all-gather scales when its float8 weights changed since the last time."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # The layers, not their parameters: materialization may give a layer new parameter objects.
        self.layers = [m for m in model.modules() if any(is_cast_wrapper(p) for p in m.parameters(recurse=False))]
        self.count = sum(is_cast_wrapper(p) for m in self.layers for p in m.parameters(recurse=False))
        self.versions: tuple[int, ...] | None = None
        #: How many times the scales were recomputed: once per weight update that a forward followed.
        self.refreshes = 0

    def _versions(self) -> tuple[int, ...] | None:
        """The float8 weights' versions, or ``None`` inside an all-gather window (a pipeline schedule unshards
        ahead): the layers then hold FSDP2's unsharded weights, which are not the ones to read."""
        weights = [p for layer in self.layers for p in layer.parameters(recurse=False) if is_cast_wrapper(p)]
        return tuple(p._version for p in weights) if len(weights) == self.count else None

    def __call__(self, *_: Any) -> None:
        _untraced(self)

    def refresh(self) -> None:
        """Recompute the scales if the weights changed since the last time."""
        versions = self._versions()
        if versions is None or versions == self.versions:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # present: the weights are its own

        precompute_float8_dynamic_scale_for_fsdp(self.model)
        self.versions = self._versions()
        self.refreshes += 1


# Not traced: a compiled block (``ParallelPlan(compile=True)``) traces its hooks with it, and the refresh reads
# tensors' versions and hands torchao's weight wrappers, whose flattening reads the precomputed scale's value, to
# Dynamo ("Please convert all Tensors to FakeTensors"). A graph break before the block, once per call.
_untraced = cast(Callable[[ScaleRefresh], None], torch.compiler.disable(ScaleRefresh.refresh))


def refresh_scales_before_forward(model: nn.Module) -> ScaleRefresh | None:
    """Install the refresh on ``model`` (after ``fully_shard``); ``None`` when nothing is all-gathered in float8.

    Idempotent: a model that has one keeps it.
    """
    existing: ScaleRefresh | None = getattr(model, _ATTRIBUTE, None)
    if existing is not None:
        return existing
    refresh = ScaleRefresh(model)
    if not refresh.layers:
        return None
    units = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule) and _holds(m, refresh)]
    owners = [model, *units]
    for owner in owners:
        owner.register_forward_pre_hook(refresh, prepend=True)
    setattr(model, _ATTRIBUTE, refresh)
    return refresh


def refresh_scales(model: nn.Module) -> None:
    """Recompute ``model``'s scales now if its weights changed (for callers that run FSDP's all-gathers
    themselves, as a pipeline schedule does); nothing for a model without float8 all-gather."""
    refresh: ScaleRefresh | None = getattr(model, _ATTRIBUTE, None)
    if refresh is not None:
        refresh()


def _holds(module: nn.Module, refresh: ScaleRefresh) -> bool:
    layers = {id(layer) for layer in refresh.layers}
    return any(id(m) in layers for m in module.modules())
