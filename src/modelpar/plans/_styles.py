"""The named tensor-parallel styles of :class:`~modelpar.plans.ParallelPlan`, and what each becomes in DTensor.

A plan names a style per submodule (``"colwise"``, ``"norm"`` ...) instead of building torch's
``ParallelStyle`` objects itself, because what a style must do depends on the plan's switches: under
sequence parallelism a row-parallel output goes back to the sequence shard, under loss parallelism the LM
head keeps its logits vocab-sharded. :func:`apply_style` turns a name into that DTensor behaviour for one
module on the tensor-parallel mesh. Activations are ``(batch, sequence, ...)``: the sequence is dim 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["STYLES", "StyleSpec", "apply_style", "sharded_dims"]

#: A plan entry: one of :data:`STYLES`' names, or any DTensor ``ParallelStyle``, applied as given.
StyleSpec = str | ParallelStyle

#: Every style name, with the module types it applies to (``()``: any module).
STYLES: dict[str, tuple[type[nn.Module], ...]] = {
    "colwise": (nn.Linear,),
    "rowwise": (nn.Linear,),
    "colwise_gather": (nn.Linear,),
    "embedding": (nn.Embedding,),
    "output": (nn.Linear,),
    "norm": (),
    "sequence_gather": (),
}

#: Styles whose output feeds a column-parallel projection's input the sequence-parallel way.
COLUMN_STYLES = ("colwise", "colwise_gather")


def sharded_dims(module: nn.Module, style: StyleSpec) -> list[tuple[str, int]]:
    """The dimensions ``style`` splits across the tensor-parallel ranks, as ``(attribute, size)`` pairs.

    A ``ParallelStyle`` with a ``sharded_dims(module)`` method of its own answers for itself.
    """
    own = getattr(style, "sharded_dims", None)
    if callable(own):
        answer: list[tuple[str, int]] = own(module)
        return answer
    colwise = style in ("colwise", "colwise_gather", "output") or isinstance(style, ColwiseParallel)
    rowwise = style in ("rowwise", "embedding") or isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear):
        if colwise:
            return [("out_features", module.out_features)]
        if rowwise:
            return [("in_features", module.in_features)]
    if isinstance(module, nn.Embedding):
        if rowwise:  # vocab-parallel: each rank holds a slice of the rows (token ids)
            return [("num_embeddings", module.num_embeddings)]
        if colwise:
            return [("embedding_dim", module.embedding_dim)]
    return []


def apply_style(
    module: nn.Module,
    style: StyleSpec,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    consumers: Sequence[nn.Module] = (),
) -> None:
    """Parallelize ``module`` in place on the 1-D ``tp_mesh`` as ``style`` says (see ``ParallelPlan``).

    A float8 layer (``modelpar.float8``) under the tensorwise recipe takes torchao's float8 variant of a named
    column- or row-parallel style; a ``"sequence_gather"`` container whose ``consumers`` (its column-parallel
    projections) are all such layers gathers its input in float8.
    """
    if isinstance(style, ParallelStyle):
        parallelize_module(module, tp_mesh, style)
        return
    from modelpar.float8._parallel import float8_input_cast, float8_style

    backend = dist.get_backend(tp_mesh.get_group())
    if style == "sequence_gather":
        if sequence_parallel:
            cast = float8_input_cast(list(consumers), backend)
            module.register_forward_pre_hook(partial(_gather_sequence, tp_mesh, cast))
        return
    if style == "norm":
        if sequence_parallel:
            parallelize_module(module, tp_mesh, SequenceParallel())
        return
    parallelize_module(
        module, tp_mesh, float8_style(module, _torch_style(style, sequence_parallel, loss_parallel), backend)
    )
    if style == "embedding" and sequence_parallel:
        module.register_forward_pre_hook(partial(_check_sequence_length, tp_mesh.size()))
    if style == "colwise_gather" or (style == "output" and not loss_parallel):
        # Runs after the style's own hook, on the gathered output that ``to_local()`` returned as a view.
        module.register_forward_hook(_output_not_a_view)


def _torch_style(name: str, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle:
    # The residual stream between blocks: replicated, or sequence-sharded under sequence parallelism.
    stream = Shard(1) if sequence_parallel else Replicate()
    if name == "colwise":
        return ColwiseParallel()
    if name == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if name == "output":
        if loss_parallel:
            return ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    raise ValueError(f"unknown style {name!r}")  # unreachable: ParallelPlan validates the names


def _gather_sequence(
    tp_mesh: DeviceMesh,
    cast: Callable[[DTensor], DTensor] | None,
    module: nn.Module,
    args: tuple[Any, ...],
) -> tuple[Any, ...] | None:
    """All-gather the first input from its sequence shard; a replicated DTensor (backward: a reduce-scatter).

    The column-parallel projections inside then share one all-gather forward and one reduce-scatter of the
    summed input gradient backward, instead of one collective each. With ``cast`` (float8 projections), the
    shard is cast to float8 first, and the all-gather moves float8 bytes.
    """
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
    if cast is not None:
        x = cast(x)
    return (x.redistribute(tp_mesh, [Replicate()]), *args[1:])


def _check_sequence_length(tp: int, module: nn.Module, args: tuple[Any, ...]) -> None:
    """Refuse a sequence that cannot be split evenly (every tensor-parallel rank sees the same batch)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 and args[0].shape[1] % tp:
        raise ValueError(
            f"Sequence parallelism splits the sequence across the {tp} tensor-parallel ranks, but this batch has"
            f" sequence length {args[0].shape[1]}. Pad or cut sequences to a multiple of {tp}, or turn"
            " sequence parallelism off."
        )


class _NotAView(torch.autograd.Function):
    """Identity whose output shares the input's storage but is not a view of it: no copy, no view."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # a new tensor over the same storage and version counter, without ``_base``

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _output_not_a_view(module: nn.Module, args: Any, output: Any) -> Any:
    if not isinstance(output, torch.Tensor) or isinstance(output, DTensor) or output._base is None:
        return None
    result: torch.Tensor = _NotAView.apply(output)
    return result
