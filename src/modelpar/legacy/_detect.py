"""Detect FSDP1-wrapped submodules and refuse them with a message that says how to migrate."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from modelpar.checkpoint import clean_name

__all__ = ["find_fsdp1_modules", "reject_fsdp1_modules"]


def find_fsdp1_modules(module: nn.Module) -> list[str]:
    """Names (as in the unwrapped model) of the FSDP1-wrapped modules in ``module``; ``"<root>"`` for itself.

    Found through ``modules()``, as Lightning's strategies look for them, then named through ``named_modules()``.
    """
    if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        return []
    try:
        named = [
            clean_name(name) or "<root>"
            for name, m in module.named_modules()
            if isinstance(m, FullyShardedDataParallel)
        ]
    except TypeError:  # a stand-in module (a test double) whose named_modules() is not iterable: no names to give
        named = []
    return named or ["<a module that `named_modules()` does not list>"]


def reject_fsdp1_modules(module: nn.Module, strategy_name: str) -> None:
    """Raise ``TypeError`` when ``module`` contains FSDP1 wrappers, which cannot be mixed with FSDP2 / DTensor."""
    paths = find_fsdp1_modules(module)
    if not paths:
        return
    shown = ", ".join(repr(p) for p in paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    raise TypeError(
        f"The model passed to `{strategy_name}` has modules wrapped with FSDP1"
        f" (`torch.distributed.fsdp.FullyShardedDataParallel`): {shown}. `{strategy_name}` only supports the new"
        " FSDP2 APIs in PyTorch >= 2.4 (`fully_shard`) and cannot take FSDP1 wrappers. Pass the unwrapped model"
        " and let the strategy shard it: give it the classes you wrapped as `auto_wrap_policy={Block}` (or"
        " `fsdp_units={Block}`), as Lightning's"
        " `FSDPStrategy` took them; or shard it in your `parallelize_fn` with"
        " `torch.distributed.fsdp.fully_shard(block, mesh=...)` on each block, then on the root. See"
        " docs/migrating-from-fsdp1.md."
    )
