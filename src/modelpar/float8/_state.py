"""Checkpoints stay precision-free: a float8 model's state dict holds plain high-precision tensors.

Under the tensorwise recipe's float8 all-gather, torchao wraps each converted weight in a tensor subclass
(``WeightWithDynamicFloat8CastTensor``) that tells FSDP2 how to cast it before the all-gather. The master weight
inside is an ordinary tensor, but ``state_dict()`` would hand out the wrapper, and a distributed checkpoint would
pickle it: a file that only loads with torchao imported and allowlisted. So each converted layer gets a
``state_dict`` post-hook that puts the ordinary tensor in its place (a view of the same storage: no copy, and a
load in place still lands in the weight). Loading needs nothing: ``copy_`` into the wrapper writes the tensor inside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["is_cast_wrapper", "keep_state_dicts_plain", "plain_tensor"]


def is_cast_wrapper(value: torch.Tensor) -> bool:
    """Whether ``value`` (or a DTensor's local shard) is a float8 cast wrapper around a plain tensor."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    wrapped = getattr(local, "_tensor", None)
    return type(local) is not torch.Tensor and type(local) is not nn.Parameter and isinstance(wrapped, torch.Tensor)


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` with a float8 cast wrapper (torchao's, or any subclass keeping its tensor in ``_tensor``)
    replaced by the tensor it wraps, inside a DTensor or not; other tensors as they are."""
    if isinstance(value, DTensor):
        local = value.to_local()
        inner = plain_tensor(local)
        if inner is local:
            return value
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if is_cast_wrapper(value):
        wrapped: torch.Tensor = value._tensor  # type: ignore[attr-defined]
        return wrapped.detach()
    return value


def _plain_entries(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor):
            state_dict[key] = plain_tensor(value)


def keep_state_dicts_plain(model: nn.Module) -> None:
    """Give every layer of ``model`` whose parameters are float8 cast wrappers the post-hook (once)."""
    for module in model.modules():
        wrapped = any(is_cast_wrapper(p) for p in module.parameters(recurse=False))
        if wrapped and not getattr(module, "_modelpar_plain_state", False):
            module.register_state_dict_post_hook(_plain_entries)
            module._modelpar_plain_state = True  # type: ignore[assignment]
