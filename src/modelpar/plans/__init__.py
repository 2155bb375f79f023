"""Parallelization plans: :class:`ParallelPlan` (declarative, one per model family) and the ready-made ones.

A plan is a ``parallelize_fn``: pass one to ``ModelParallelStrategy``. :func:`loss_parallel` goes around the
loss and backward in the training step when a plan keeps the logits vocab-sharded. See ``docs/plans.md``.
"""

from modelpar._errors import UnsupportedStyleError
from modelpar.plans._loss import loss_parallel
from modelpar.plans._plan import ActivationCheckpointing, ParallelPlan
from modelpar.plans._styles import STYLES
from modelpar.plans._units import ModuleSelector
from modelpar.plans.llama import LLAMA_MOE_PLAN, LLAMA_PLAN, LlamaParallelConfig, llama_tp_plan, parallelize_llama

#: The style names a :class:`ParallelPlan` understands.
STYLE_NAMES: tuple[str, ...] = tuple(STYLES)

__all__ = [
    "LLAMA_MOE_PLAN",
    "LLAMA_PLAN",
    "STYLE_NAMES",
    "ActivationCheckpointing",
    "LlamaParallelConfig",
    "ModuleSelector",
    "ParallelPlan",
    "UnsupportedStyleError",
    "llama_tp_plan",
    "loss_parallel",
    "parallelize_llama",
]
