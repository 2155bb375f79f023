"""modelpar: N-D model parallelism (FSDP2 + tensor parallelism on a named DeviceMesh) for Lightning.

Public surface: :class:`ModelParallelStrategy` (Fabric and standalone ``torchrun``), mesh-aware
gradient clipping, the :mod:`modelpar.checkpoint` formats, and the error types (each also a subclass of
the type Lightning or torch raises in the same situation). Ready-made parallelization plans live in
:mod:`modelpar.plans`, small reference models in :mod:`modelpar.models`.
"""

from modelpar._clip import clip_grad_norm, clip_grad_value
from modelpar._errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    CorruptCheckpointError,
    MeshSizeError,
    UnsupportedReduceOpError,
    WeightsOnlyError,
)
from modelpar._mesh import MESH_AXES, MeshLayout
from modelpar._precision import SUPPORTED_PRECISIONS
from modelpar.fabric import ModelParallelStrategy

__version__ = "0.1.0.dev0"

__all__ = [
    "ModelParallelStrategy",
    "MeshLayout",
    "MESH_AXES",
    "SUPPORTED_PRECISIONS",
    "clip_grad_norm",
    "clip_grad_value",
    "MeshSizeError",
    "CheckpointNotFoundError",
    "CheckpointKeyError",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "WeightsOnlyError",
    "UnsupportedReduceOpError",
    "__version__",
]
