"""Module set-up under pipeline parallelism: cut, parallelize each stage, materialize this rank's part, prune.

The order is the one-stage set-up's (``ParallelCore.setup_module``), run per stage:

1. The plan is chosen on the whole model (``parallelize_fn``, or the strategy's own from names and shapes), and the
   model is cut (``modelpar.pipeline``): every rank computes the same cut, or raises the same error, before any
   collective.
2. ``parallelize_fn`` runs on each of this rank's stages (a view of the model holding only that stage's modules):
   TP, activation checkpointing, compile and FSDP per stage, each stage its own root FSDP unit, as torchtitan does,
   so that torch's ``PipelineStage`` drives FSDP's gradient reduction once per step. A plan's patterns that name
   modules of other stages only are skipped on this one.
3. The strategy's checks run on every stage; then the tensors are materialized with the whole model's
   initialization order (the other stages' modules draw on throwaway storage), so the values equal one process's.
4. The model is pruned in place to this rank's stages and carries its :class:`~modelpar.pipeline._run.Pipeline`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modelpar._init.materialize import has_meta_tensors
from modelpar._init.placement import materialize, offloads
from modelpar._mesh.layout import PIPELINE_PARALLEL_AXIS
from modelpar._mesh.submeshes import token_mesh
from modelpar._rank_zero import rank_zero_info, rank_zero_warn
from modelpar._strategy.applied import check_context_parallel_applied, check_expert_parallel_applied, parallelized
from modelpar._strategy.float8 import keep_scales_current
from modelpar.checkpoint._names import clean_name
from modelpar.pipeline._build import local_stages
from modelpar.pipeline._run import PIPELINE_ATTRIBUTE, Pipeline
from modelpar.pipeline._schedules import check_schedule_settings, schedule_spec
from modelpar.pipeline._stage import prune

if TYPE_CHECKING:
    from modelpar._strategy.core import ParallelCore

__all__ = ["setup_pipeline"]

#: Config fields of a router's auxiliary loss: ``modelpar.models.LlamaConfig``'s, Hugging Face MoE families'.
_AUX_LOSS_COEFFICIENTS = ("aux_loss_coef", "z_loss_coef", "router_aux_loss_coef", "router_z_loss_coef")


def setup_pipeline(core: ParallelCore, module: nn.Module, parallelize_fn: Any, root_device: torch.device) -> bool:
    """Cut ``module`` into this rank's stages, parallelize and materialize them, prune ``module`` to them.

    Returns whether the stages' FSDP units offload to the CPU (the core records it on the module)."""
    layout, options, mesh = core.layout, core.options, core.device_mesh
    assert layout is not None  # set up before modules; not user-facing
    spec = schedule_spec(options.pipeline_schedule)
    per_rank, microbatches = check_schedule_settings(
        spec,
        pipeline_parallel_size=layout.pipeline_parallel_size,
        stages_per_rank_arg=options.pipeline_stages_per_rank,
        microbatches=options.pipeline_microbatches,
    )
    pipeline_mesh = mesh[PIPELINE_PARALLEL_AXIS]
    local = local_stages(
        module,
        spec=spec,
        pipeline_rank=pipeline_mesh.get_local_rank(),
        pipeline_parallel_size=layout.pipeline_parallel_size,
        per_rank=per_rank,
        pipeline_split=options.pipeline_split,
    )
    stages: list[nn.Module] = []
    for view in local.views:
        stages.append(parallelized(parallelize_fn, parallelize_fn(view, mesh)) if parallelize_fn is not None else view)
    offloading: list[bool] = []
    for stage in stages:
        offloading += core.check_fsdp_applied(stage)
        check_context_parallel_applied(stage, layout)
        check_expert_parallel_applied(stage, layout)
    offload = offloads(
        offloading,
        root_device=root_device,
        has_meta=any(has_meta_tensors(stage) for stage in stages),
        strategy_name=core.strategy_name,
    )
    materialize(module, root_device, offload=offload, stage_roots=stages, absent=local.absent)
    for stage in stages:
        keep_scales_current(stage)
    whole_keys = frozenset(clean_name(key) for key in module.state_dict(keep_vars=True))
    prune(module, local.kept)
    core.warn_if_unsharded(module)
    tokens = token_mesh(mesh)
    setattr(
        module,
        PIPELINE_ATTRIBUTE,
        Pipeline(
            spec=spec,
            modules=stages,
            stage_indices=list(local.indices),
            num_stages=layout.pipeline_parallel_size * per_rank,
            microbatches=microbatches,
            device=root_device,
            pipeline_group=pipeline_mesh.get_group(),
            token_group=tokens.get_group() if tokens.size() > 1 else None,
            token_ranks=tokens.size(),
            tensor_parallel_size=layout.tensor_parallel_size,
            whole_state_keys=whole_keys,
        ),
    )
    config = getattr(module, "config", None)
    experts = max((getattr(config, n, 0) or 0 for n in ("n_experts", "num_experts", "num_local_experts")), default=0)
    aux = {name: getattr(config, name, 0) for name in _AUX_LOSS_COEFFICIENTS} if experts else {}
    if any(isinstance(v, (int, float)) and v > 0 for v in aux.values()):
        given = ", ".join(f"{k}={v}" for k, v in aux.items() if isinstance(v, (int, float)) and v > 0)
        rank_zero_warn(
            f"The model's routers add an auxiliary loss ({given}), but under pipeline parallelism the loss is what"
            " `pipeline_step`'s `loss_fn` computes from the last stage's output, so the MoE blocks' auxiliary"
            " losses are not trained. Set their coefficients to 0 (auxiliary-loss-free balancing), or use"
            " `pipeline_parallel_size=1`."
        )
    module.register_forward_pre_hook(_refuse_direct_call)
    rank_zero_info(
        f"{core.strategy_name}: {type(module).__name__} cut into {len(local.cut.stages)} pipeline stages"
        f" ({spec.name}, {microbatches} micro-batches): {local.cut.describe()}."
    )
    return offload


def _refuse_direct_call(module: nn.Module, args: Any) -> None:
    """A pipelined model holds some stages only: calling it would run them on the wrong input, or fail far away."""
    indices = getattr(module, PIPELINE_ATTRIBUTE).stage_indices
    raise RuntimeError(
        f"{type(module).__name__} is cut into pipeline stages (this rank holds stage(s) {indices}), so it cannot be"
        " called as a whole. Train with `strategy.pipeline_step(model, inputs, targets, loss_fn)` and evaluate with"
        " `strategy.pipeline_eval(...)`."
    )
