"""The strategy's ``float8`` option: which plan converts the model, and the scales kept current whoever converted it.

``float8`` belongs to a plan (``ParallelPlan(float8=...)``: the conversion must come first in the plan's order).
The strategy's option hands it to the plan the strategy applies: the one it makes when no ``parallelize_fn`` is
given (the no-code path), or the ``ParallelPlan`` given as ``parallelize_fn``. A function of the user's own cannot
be reordered from outside, so it converts the model itself; the option is refused there, naming the call. Whoever
converted, :func:`keep_scales_current` gives a model whose weights FSDP2 all-gathers in float8 its scale refresh.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from modelpar.float8._scales import refresh_scales_before_forward
from modelpar.float8._spec import Float8Training
from modelpar.plans import ParallelPlan

__all__ = ["keep_scales_current", "with_float8"]


def with_float8(parallelize_fn: Any, float8: Float8Training | None, strategy_name: str) -> Any:
    """``parallelize_fn`` with the strategy's ``float8`` in it: a plan gets it, ``None`` stays (the strategy's own
    plan takes it later); a function of the user's own is refused."""
    if float8 is None or parallelize_fn is None:
        return parallelize_fn
    if isinstance(parallelize_fn, ParallelPlan):
        if parallelize_fn.float8 is not None and parallelize_fn.float8 != float8:
            raise ValueError(
                f"`{strategy_name}(float8={float8!r})` and its plan's `float8={parallelize_fn.float8!r}` disagree."
                " Set float8 in one place: on the plan, or on the strategy."
            )
        return parallelize_fn.replace(float8=float8)
    name = getattr(parallelize_fn, "__name__", type(parallelize_fn).__name__)
    raise ValueError(
        f"`{strategy_name}(float8={float8.recipe!r})` goes to the plan the strategy applies, but `parallelize_fn`"
        f" ({name}) is a function of your own, whose steps the strategy cannot reorder (float8 comes before tensor"
        " parallelism and FSDP). Convert the model first in your function, `modelpar.float8.convert(model,"
        f" Float8Training({float8.recipe!r}), device_mesh=device_mesh)`, and drop the strategy's"
        " `float8`; or pass a `modelpar.plans.ParallelPlan`."
    )


def keep_scales_current(module: nn.Module) -> None:
    """After set-up: a model whose weights FSDP2 all-gathers in float8 (converted by a plan, by
    ``modelpar.float8.convert`` or by torchao directly) refreshes their scales after each weight update."""
    refresh_scales_before_forward(module)
