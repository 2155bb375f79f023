"""Float8 training (torchao) from a plan field: ``ParallelPlan(float8="rowwise")``, on every layout.

The plan converts the model's ``nn.Linear`` layers with torchao's public float8 training API before tensor
parallelism and FSDP (:func:`convert`; the ``float8`` extra), picks torchao's float8 tensor-parallel styles under
the tensorwise recipe, and lets FSDP2 all-gather the weights in float8, with their scales refreshed after each
weight update by the model itself. Master weights, optimizer states and checkpoints stay in high precision. See
``docs/float8.md``.
"""

from modelpar.float8._convert import FLOAT8_CAPABILITY, check_float8_device, convert, float8_layers
from modelpar.float8._scales import refresh_scales
from modelpar.float8._spec import RECIPES, Float8Recipe, Float8Training
from modelpar.float8._torchao import MIN_TORCHAO

__all__ = [
    "FLOAT8_CAPABILITY",
    "MIN_TORCHAO",
    "RECIPES",
    "Float8Recipe",
    "Float8Training",
    "check_float8_device",
    "convert",
    "float8_layers",
    "refresh_scales",
]
