"""Which Lightning precision plugins make sense with FSDP2 + DTensor, and a clear refusal for the rest.

Fabric's connector refuses unsupported precisions only for Lightning's own ``ModelParallelStrategy``
class, so a strategy that is not that class must check for itself, at the moment the plugin is attached.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, TypeVar

from modelpar._strategy.lightning import classes

__all__ = ["SUPPORTED_PRECISIONS", "check_precision", "without_autocast"]

TPlugin = TypeVar("TPlugin")

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")

_WHY = {
    # fp16 autocast needs a gradient scaler that understands sharded DTensor gradients; torch's
    # ShardedGradScaler targets FSDP1, so the combination would silently skip inf checks on TP shards.
    "16-mixed": (
        " fp16 mixed precision needs a gradient scaler that works on sharded DTensor gradients, which"
        " FSDP2 + tensor parallelism does not provide. Use precision='bf16-mixed' (no scaler needed)."
    ),
}


def check_precision(precision: Any, strategy_name: str) -> None:
    """Raise ``ValueError`` unless ``precision`` is one of the plugins Fabric builds for the supported names.

    The type is checked as well as the name: a third-party plugin (quantization, transformer-engine)
    rewrites modules in ways FSDP2 does not expect even when it reports a supported name. The plugin may
    come from either Lightning namespace (``lightning.fabric`` or ``lightning_fabric``).
    """
    name = str(getattr(precision, "precision", type(precision).__name__))
    mixed_or_half = classes("fabric", "plugins.MixedPrecision") + classes("fabric", "plugins.HalfPrecision")
    known_type = type(precision) in classes("fabric", "plugins.Precision") or isinstance(precision, mixed_or_half)
    if known_type and name in SUPPORTED_PRECISIONS:
        return
    raise ValueError(
        f"The `{strategy_name}` does not support precision {name!r} ({type(precision).__name__})."
        + _WHY.get(name, "")
        + f" Choose one of: {', '.join(SUPPORTED_PRECISIONS)}."
    )


def without_autocast(plugin: TPlugin) -> TPlugin:
    """A copy of ``plugin`` whose ``forward_context`` enters no autocast; everything else is the plugin's own.

    Used when FSDP2's mixed-precision policy already computes in bf16 (``"bf16-mixed"`` with the derived
    policy): autocast on top would keep fp32 masters plus bf16 copies of every weight until backward and run
    some ops in fp32 again. The forward context is what Fabric's module wrapper and the Trainer's step contexts
    enter, so only they change; ``fabric.autocast()`` keeps using the original plugin, for code that asks for
    autocast explicitly. A shallow copy: the precision plugins keep no per-step state.
    """
    quiet = copy.copy(plugin)
    quiet.forward_context = nullcontext  # type: ignore[attr-defined]
    return quiet
