"""The memory estimate: per-rank bytes of a layout, and which layouts fit a GPU, computed from a
:class:`~modelpar.plans.ParallelPlan` on the meta device before anything runs (``docs/memory.md``).

:func:`estimate_memory` (also exported from :mod:`modelpar`) returns a :class:`MemoryEstimate`; :func:`search_layouts`
tries every layout of a world size. Inside: the state and the peak (``_estimate``, ``_state``, ``_report``,
``_transients``), activations (``_activations``, compiled layers: ``_compiled``, mixtures of experts: ``_moe``),
pipeline stages and schedules (``_pipeline``, ``_schedule``), float8 training (``_float8``), the search (``_search``)
and models on the meta device from a config (``_meta_models``). May import plans, models, hf, pipeline, float8 (which
layers convert: names and shapes, no torchao), and the lower layers (``_mesh``, ``_train``); never the strategy.
"""

from modelpar.memory._estimate import estimate_memory
from modelpar.memory._report import MemoryEstimate
from modelpar.memory._search import Fit, search_layouts

__all__ = ["Fit", "MemoryEstimate", "estimate_memory", "search_layouts"]
