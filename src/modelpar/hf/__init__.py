"""Hugging Face pretrained weights in and out of sharded models (the ``hf`` extra).

:func:`load_pretrained` fills a model set up by the strategy (FSDP2 and/or tensor parallelism, built on the
meta device) from a pretrained folder, each rank reading only its own blocks of the memory-mapped
safetensors files. :func:`save_pretrained` writes a running sharded model as a pretrained folder, one
gathered tensor at a time; :func:`export_checkpoint` (``modelpar convert SRC DST --to hf --config DIR``)
does the same offline from a distributed checkpoint folder. The folders load with ``from_pretrained``.
:func:`plan_for` turns the model's own tensor-parallel plan into a :class:`~modelpar.plans.ParallelPlan`.
:func:`router_aux_loss` is a MoE model's load-balancing loss over the global batch (the model's own is per rank);
:func:`with_global_router_loss` puts it in place of the per-rank one in ``outputs.loss``.
"""

import importlib.util

_missing = [name for name in ("transformers", "safetensors") if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"`modelpar.hf` needs {' and '.join(_missing)}, which {'is' if len(_missing) == 1 else 'are'} not installed."
        " Install the extra: pip install 'modelpar[hf]'"
    )

from modelpar.hf._aux import router_aux_loss, with_global_router_loss  # noqa: E402  (after the check, for its message)
from modelpar.hf._export import export_checkpoint  # noqa: E402
from modelpar.hf._load import load_pretrained  # noqa: E402
from modelpar.hf._plan import plan_for  # noqa: E402
from modelpar.hf._save import save_pretrained  # noqa: E402
from modelpar.hf._styles import RefusedStyleError  # noqa: E402

__all__ = [
    "RefusedStyleError",
    "load_pretrained",
    "save_pretrained",
    "export_checkpoint",
    "plan_for",
    "router_aux_loss",
    "with_global_router_loss",
]
