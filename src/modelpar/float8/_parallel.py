"""Tensor parallelism over float8 layers: torchao's float8 styles where they pay, torch's where they do not.

Under the tensorwise recipe a column- or row-parallel ``Float8Linear`` takes torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` (the same sharding as torch's, with the input cast to float8 before its all-gather and the
output gradient cast in backward), and a sequence-parallel block gathers its input in float8 once for all its
projections (what torchao's ``PrepareFloat8ModuleInput`` does): half the bytes of bf16 on the tensor-parallel
links. Rowwise recipes keep torch's own styles (torchtitan's choice: one scale per row does not survive the
gather), which ``Float8Linear`` takes as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["FLOAT8_COLLECTIVE_BACKENDS", "float8_input_cast", "float8_style", "is_tensorwise_float8"]


def is_tensorwise_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Float8Linear`` that scales its input and output gradient per tensor, dynamically."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType  # present: the module is its own

    config: Any = module.config
    casts = (config.cast_config_input, config.cast_config_grad_output)
    return all(
        c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts
    )


def float8_style(module: nn.Module, style: ParallelStyle, backend: str) -> ParallelStyle:
    """torchao's float8 variant of a column- or row-parallel ``style`` (same layouts) for a tensorwise float8 layer,
    on a ``backend`` whose collectives move float8 tensors; ``style`` itself otherwise.

    torch's own style computes the same float8 numerics (the layer casts the DTensor it is given, with the whole
    tensor's scale); torchao's casts before the collectives, which then move half the bytes.
    """
    if backend not in FLOAT8_COLLECTIVE_BACKENDS:
        return style
    if not is_tensorwise_float8(module) or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    kind = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
    given: Any = style
    made: ParallelStyle = kind(  # the layouts, as the plan chose them
        input_layouts=given.input_layouts[0],
        output_layouts=given.output_layouts[0],
        use_local_output=given.use_local_output,
    )
    return made


#: The process-group backends whose collectives move float8 tensors (gloo refuses them: "Invalid scalar type").
FLOAT8_COLLECTIVE_BACKENDS = ("nccl",)


def float8_input_cast(consumers: list[nn.Module], backend: str) -> Callable[[DTensor], DTensor] | None:
    """For a sequence-parallel container whose gathered input feeds only tensorwise float8 layers (``consumers``,
    its column-parallel projections): the cast to float8 to apply before the all-gather, on a ``backend`` that
    gathers float8 tensors. Elsewhere ``None``: the input is gathered in high precision and each layer casts it,
    with the same scale (the whole tensor's), so the numerics are the same and only the bytes differ."""
    if backend not in FLOAT8_COLLECTIVE_BACKENDS:
        return None
    if not consumers or not all(is_tensorwise_float8(m) for m in consumers):
        return None
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    config = consumers[0].linear_mm_config
    if any(m.linear_mm_config != config for m in consumers):
        return None

    def cast(x: DTensor) -> DTensor:
        result: DTensor = hp_tensor_to_float8_dynamic(x, e4m3_dtype, config, gemm_input_role=GemmInputRole.INPUT)
        return result

    return cast
