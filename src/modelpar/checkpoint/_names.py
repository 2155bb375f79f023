"""Stable parameter names: the wrapper segments that must never reach a checkpoint key.

FSDP1 (``_fsdp_wrapped_module``), activation-checkpoint wrappers (``_checkpoint_wrapped_module``) and
``torch.compile`` (``_orig_mod``) insert a segment into every name below them. Checkpoints use the names of
the plain model, so a checkpoint written with any of these loads into a model without them and back.
"""

from __future__ import annotations

from torch import nn

__all__ = ["WRAPPER_SEGMENTS", "clean_name", "named_parameters_clean"]

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """``name`` without wrapper segments: ``layers.0._checkpoint_wrapped_module.w`` -> ``layers.0.w``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def named_parameters_clean(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's parameters by stable name; refuses FSDP1 flat parameters, which have no per-tensor name."""
    params: dict[str, nn.Parameter] = {}
    for name, param in module.named_parameters():
        if name.split(".")[-1] == "_flat_param":
            raise ValueError(
                f"The module holds FSDP1 flat parameters ({name!r}), which merge many tensors into one, so they have"
                " no per-tensor names. Wrap with `use_orig_params=True` (Lightning's default), or convert with"
                " `FullyShardedDataParallel.optim_state_dict` while the FSDP1 model exists."
            )
        params[clean_name(name)] = param
    return params
