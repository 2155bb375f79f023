"""Tensor-parallel plan and FSDP2 wrapping for Llama-style models (torchtitan's module naming).

Order: tensor parallelism on the ``tensor_parallel`` axis first, then ``fully_shard`` bottom-up (each
block, then the root) with :func:`modelpar.fsdp_kwargs`: the data-parallel mesh (2-D replicate x shard
under HSDP) and the strategy's FSDP2 policies (mixed precision, CPU offload, resharding).
Attention and MLP are split Megatron-style: column-parallel in, row-parallel out, so each block costs one
all-reduce forward and one backward. The shapes are checked against the TP size before anything is
sharded, so a bad combination fails with the numbers instead of a shape error deep in a forward pass.

The output projection gathers the logits and hands them out as a plain tensor. ``DTensor.to_local()``
returns that tensor as a view, and a view returned by an FSDP2 module makes torch warn that an in-place op
on it would skip the module's backward all-gather; the plan returns the logits as a fresh tensor over the
same storage instead (no copy, same values), so in-place ops on them are safe and nothing warns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from modelpar._fsdp import fsdp_kwargs

__all__ = ["LlamaParallelConfig", "llama_tp_plan", "parallelize_llama"]


@dataclass(frozen=True)
class LlamaParallelConfig:
    """Options for :func:`parallelize_llama`.

    Each field left at ``None`` takes the strategy's option (see :func:`modelpar.fsdp_kwargs`); set, it wins.

    Attributes:
        reshard_after_forward: free gathered weights after forward (ZeRO-3); ``False`` keeps them until
            backward (ZeRO-2: more memory, one all-gather less per block).
        mp_policy: FSDP2 mixed precision (e.g. bf16 params/compute with fp32 gradient reduction).
    """

    reshard_after_forward: bool | int | None = None
    mp_policy: MixedPrecisionPolicy | None = None


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """The per-block plan, as a readable dict of submodule name -> parallel style."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


class _NotAView(torch.autograd.Function):
    """Identity whose output shares the input's storage but is not a view of it: no copy, no view."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # a new tensor over the same storage and version counter, without ``_base``

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _output_not_a_view(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _NotAView.apply(output)
    return result


def _check_divisible(model: nn.Module, tp: int) -> None:
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        return
    checks = {
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "ffn_hidden": cfg.ffn_hidden,
        "vocab_size": cfg.vocab_size,
    }
    bad = {name: value for name, value in checks.items() if value % tp}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's {', '.join(bad)}, but {shown}."
            f" Choose a tensor-parallel size that divides them, or change the model."
        )


def parallelize_llama(
    model: nn.Module, device_mesh: DeviceMesh, config: LlamaParallelConfig | None = None
) -> nn.Module:
    """Apply TP (if the tensor-parallel axis has > 1 rank) then FSDP2 to a Llama-style ``model``; return it."""
    config = config or LlamaParallelConfig()
    tp_mesh = device_mesh["tensor_parallel"]
    tp = tp_mesh.size()
    if tp > 1:
        _check_divisible(model, tp)
        top_plan: dict[str, ParallelStyle] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, tp_mesh, top_plan)
        # Runs after the style's own hook, on the local logits that ``to_local()`` returned as a view.
        model.get_submodule("output").register_forward_hook(_output_not_a_view)
        for block in model.layers:  # type: ignore[union-attr]
            parallelize_module(block, tp_mesh, llama_tp_plan())
    overrides: dict[str, Any] = {}
    if config.reshard_after_forward is not None:
        overrides["reshard_after_forward"] = config.reshard_after_forward
    if config.mp_policy is not None:
        overrides["mp_policy"] = config.mp_policy
    kwargs = fsdp_kwargs(device_mesh, **overrides)
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
