"""modelpar: N-D model parallelism (FSDP2 + tensor parallelism on a named DeviceMesh) for Lightning.

Public surface: :class:`ModelParallelStrategy` (Fabric and standalone ``torchrun``), :func:`fsdp_kwargs`
(what a ``parallelize_fn`` passes to ``fully_shard``: the data-parallel mesh, HSDP-aware, and the strategy's
FSDP2 policies), mesh-aware gradient clipping, the :mod:`modelpar.checkpoint` formats, and the error types
(each also a subclass of the type Lightning or torch raises in the same situation). Ready-made parallelization
plans live in :mod:`modelpar.plans`, small reference models in :mod:`modelpar.models`.

The names below other than the error types are imported when first used (PEP 562), not with the package: a
subpackage such as :mod:`modelpar.checkpoint`, and the ``modelpar`` command line, then start without importing
Lightning (about 2.5 s of CPU per process). ``from modelpar import ModelParallelStrategy`` works as before and
registers the strategy with every installed Lightning namespace on that first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from modelpar._errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    CorruptCheckpointError,
    MeshSizeError,
    PipelineSplitError,
    ShardingStrategyError,
    UnsupportedReduceOpError,
    UnsupportedStyleError,
    WeightsOnlyError,
)

if TYPE_CHECKING:
    from modelpar._mesh.layout import HSDP_MESH_AXES, MESH_AXES, MeshLayout
    from modelpar._mesh.submeshes import fsdp_mesh
    from modelpar._strategy.precision import SUPPORTED_PRECISIONS
    from modelpar._train.clip import clip_grad_norm, clip_grad_value
    from modelpar._train.fsdp import fsdp_kwargs
    from modelpar.fabric import ModelParallelStrategy
    from modelpar.memory import MemoryEstimate, estimate_memory

__version__ = "0.1.0.dev0"

__all__ = [
    "ModelParallelStrategy",
    "MeshLayout",
    "MESH_AXES",
    "HSDP_MESH_AXES",
    "fsdp_kwargs",
    "fsdp_mesh",
    "estimate_memory",
    "MemoryEstimate",
    "SUPPORTED_PRECISIONS",
    "clip_grad_norm",
    "clip_grad_value",
    "MeshSizeError",
    "PipelineSplitError",
    "ShardingStrategyError",
    "CheckpointNotFoundError",
    "CheckpointKeyError",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "WeightsOnlyError",
    "UnsupportedReduceOpError",
    "UnsupportedStyleError",
    "__version__",
]

#: Where each name imported on first use lives.
_LAZY = {
    "ModelParallelStrategy": "modelpar.fabric",
    "MeshLayout": "modelpar._mesh.layout",
    "MESH_AXES": "modelpar._mesh.layout",
    "HSDP_MESH_AXES": "modelpar._mesh.layout",
    "fsdp_kwargs": "modelpar._train.fsdp",
    "fsdp_mesh": "modelpar._mesh.submeshes",
    "estimate_memory": "modelpar.memory",
    "MemoryEstimate": "modelpar.memory",
    "SUPPORTED_PRECISIONS": "modelpar._strategy.precision",
    "clip_grad_norm": "modelpar._train.clip",
    "clip_grad_value": "modelpar._train.clip",
}


#: The subpackages reachable as attributes of the package without their own import (``modelpar.plans.X`` after
#: ``import modelpar``), as when the package imported them all; the extras' (``hf``, ``trainer``) need theirs.
_SUBPACKAGES = frozenset(
    {"checkpoint", "context", "fabric", "float8", "legacy", "memory", "models", "moe", "pipeline", "plans"}
)


if not TYPE_CHECKING:  # type checkers read the imports above, and still flag a misspelt name

    def __getattr__(name: str) -> Any:
        """Import a public name or subpackage on first use and keep it, so later lookups are plain attribute reads."""
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
        elif name in _SUBPACKAGES:
            value = importlib.import_module(f"modelpar.{name}")
        else:
            raise AttributeError(f"module 'modelpar' has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBPACKAGES)
