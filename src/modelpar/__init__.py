"""modelpar: N-D model parallelism (FSDP2 + tensor parallelism on a named DeviceMesh) for Lightning.

Public surface: :class:`ModelParallelStrategy` (Fabric and standalone ``torchrun``), mesh-aware
gradient clipping, and the :mod:`modelpar.checkpoint` formats. Ready-made parallelization plans live in
:mod:`modelpar.plans`, small reference models in :mod:`modelpar.models`.
"""

from modelpar._clip import clip_grad_norm, clip_grad_value
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
    "__version__",
]
