"""The plan for Llama-style models (torchtitan's module naming): :data:`LLAMA_PLAN` and :func:`parallelize_llama`.

Attention and MLP are split Megatron-style: column-parallel in, row-parallel out, so each block costs one
all-reduce forward and one backward (with sequence parallelism: an all-gather and a reduce-scatter each, on
sequence shards, and the norms run on ``seq / tp`` tokens). The token embedding is vocab-parallel, the LM
head column-parallel with gathered logits, or vocab-sharded ones under loss parallelism. Each block is an FSDP
unit, the root is sharded last. The shapes are checked against the TP size before anything is sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from modelpar.plans._plan import ParallelPlan

__all__ = ["LLAMA_MOE_PLAN", "LLAMA_PLAN", "LlamaParallelConfig", "llama_tp_plan", "parallelize_llama"]

#: ``modelpar.models.Llama`` and models named like it (torchtitan's ``tok_embeddings``, ``layers.*.attention.wq``
#: ...). Defaults: tensor parallelism without sequence or loss parallelism, blocks as FSDP units, no activation
#: checkpointing, no compile; toggle with ``LLAMA_PLAN.replace(sequence_parallel=True, ...)``.
LLAMA_PLAN = ParallelPlan(
    tensor_parallel={
        "tok_embeddings": "embedding",
        "layers.*.attention_norm": "norm",
        "layers.*.attention": "sequence_gather",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "norm",
        "layers.*.feed_forward": "sequence_gather",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": "norm",
        "output": "output",
    },
    fsdp_units=("layers.*",),
    attention=("layers.*.attention",),
)

#: The MoE variant of ``modelpar.models.Llama`` (``LlamaConfig(n_experts=...)``, every block a MoE): attention,
#: embedding and head as in :data:`LLAMA_PLAN`, the MoE modules named by ``experts`` (split over the expert axis
#: under ``expert_parallel_size > 1``, router replicated, experts not tensor-parallel). With ``moe_every > 1`` add
#: the dense blocks' ``layers.*.feed_forward.*`` entries of :data:`LLAMA_PLAN`.
LLAMA_MOE_PLAN = LLAMA_PLAN.replace(
    tensor_parallel={k: v for k, v in LLAMA_PLAN.tensor_parallel.items() if ".feed_forward" not in k},
    experts=("layers.*.moe",),
)


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
    """One block's plan (without sequence parallelism), as torch styles: submodule name -> parallel style.

    For ``parallelize_module(block, device_mesh["tensor_parallel"], llama_tp_plan())`` in a hand-written
    ``parallelize_fn``; :data:`LLAMA_PLAN` is the whole-model plan.
    """
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def parallelize_llama(
    model: nn.Module, device_mesh: DeviceMesh, config: LlamaParallelConfig | None = None
) -> nn.Module:
    """Apply :data:`LLAMA_PLAN` (TP if the tensor-parallel axis has > 1 rank, then FSDP2) to ``model``; return it.

    ``config``'s fields that are set override the strategy's FSDP2 options, as ``LLAMA_PLAN.replace(...)`` would.
    """
    plan = LLAMA_PLAN
    if config is not None:
        plan = plan.replace(reshard_after_forward=config.reshard_after_forward, mp_policy=config.mp_policy)
    return plan(model, device_mesh)
