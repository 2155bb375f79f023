"""modelpar: N-D model parallelism (FSDP2 + tensor parallelism on a named DeviceMesh) for Lightning.

Public surface: :class:`ModelParallelStrategy` (Fabric and standalone ``torchrun``), :func:`fsdp_kwargs`
(what a ``parallelize_fn`` passes to ``fully_shard``: the data-parallel mesh, HSDP-aware, and the strategy's
FSDP2 policies), mesh-aware gradient clipping, the :mod:`modelpar.checkpoint` formats, and the error types
(each also a subclass of the type Lightning or torch raises in the same situation). Ready-made parallelization
plans live in :mod:`modelpar.plans`, small reference models in :mod:`modelpar.models`.
"""

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
