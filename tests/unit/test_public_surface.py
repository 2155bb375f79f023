"""The public surface: every name users import, from the module they import it from.

Written down literally (taken from the tree before the package was grouped by concept, issue 26), so that a move
inside the package cannot drop or relocate a public name unnoticed: each module's ``__all__`` is exactly this
list, and each name imports from that module. A change here is a change of the public API: say so in CHANGELOG.md.
"""

from __future__ import annotations

import importlib

import pytest

SURFACE: dict[str, list[str]] = {
    "modelpar": [
        "CheckpointKeyError",
        "CheckpointNotFoundError",
        "CheckpointShapeError",
        "CorruptCheckpointError",
        "HSDP_MESH_AXES",
        "MESH_AXES",
        "MemoryEstimate",
        "MeshLayout",
        "MeshSizeError",
        "PipelineSplitError",
        "ShardingStrategyError",
        "ModelParallelStrategy",
        "SUPPORTED_PRECISIONS",
        "UnsupportedReduceOpError",
        "UnsupportedStyleError",
        "WeightsOnlyError",
        "__version__",
        "clip_grad_norm",
        "clip_grad_value",
        "estimate_memory",
        "fsdp_kwargs",
        "fsdp_mesh",
    ],
    "modelpar.checkpoint": [
        "CheckpointFormat",
        "CheckpointKeyError",
        "CheckpointNotFoundError",
        "CheckpointShapeError",
        "Checkpointer",
        "CorruptCheckpointError",
        "RunCheckpoints",
        "WeightsOnlyError",
        "clean_name",
        "convert_to_distributed",
        "convert_to_file",
        "describe_checkpoint",
        "detect_format",
        "load_state",
        "optimizer_state_to_names",
        "optimizer_state_to_positions",
        "save_state",
    ],
    "modelpar.context": [
        "ContextParallelAttention",
        "context_parallel_attention",
        "cross_entropy",
        "load_balanced_positions",
        "shard_batch",
        "shard_sequence",
        "shift_labels_for_causal_lm",
        "unshard_sequence",
        "use_context_parallel_attention",
    ],
    "modelpar.fabric": [
        "ModelParallelStrategy",
    ],
    "modelpar.hf": [
        "RefusedStyleError",
        "export_checkpoint",
        "load_pretrained",
        "plan_for",
        "router_aux_loss",
        "save_pretrained",
        "with_global_router_loss",
    ],
    "modelpar.legacy": [
        "FSDP1_ARGUMENTS",
        "translate_fsdp1_arguments",
        "wrap_policy_selector",
        "find_fsdp1_modules",
        "reject_fsdp1_modules",
    ],
    "modelpar.models": [
        "Llama",
        "LlamaConfig",
    ],
    "modelpar.moe": [
        "ExpertParallel",
        "all_to_all",
        "check_moe_module",
        "expert_fsdp_mesh",
        "expert_parallel_mesh",
        "parallelize_experts",
        "sum_over_group",
    ],
    "modelpar.plans": [
        "ActivationCheckpointing",
        "LLAMA_MOE_PLAN",
        "LLAMA_PLAN",
        "LlamaParallelConfig",
        "ModuleSelector",
        "ParallelPlan",
        "STYLE_NAMES",
        "UnsupportedStyleError",
        "llama_tp_plan",
        "loss_parallel",
        "parallelize_llama",
    ],
    "modelpar.trainer": [
        "ModelParallelStrategy",
    ],
    # new with issue 28: pipeline parallelism
    "modelpar.pipeline": [
        "OFFERED_SCHEDULES",
        "PIPELINE_SCHEDULES",
        "PipelineSchedule",
        "PipelineSplitError",
        "ScheduleSpec",
        "StageCut",
        "StageLayers",
        "balance",
        "cut_model",
    ],
    # new with issue 29: float8 training
    "modelpar.float8": [
        "FLOAT8_CAPABILITY",
        "MIN_TORCHAO",
        "RECIPES",
        "Float8Recipe",
        "Float8Training",
        "check_float8_device",
        "convert",
        "float8_layers",
        "refresh_scales",
    ],
    # new with issue 26: the estimate's own public module (``estimate_memory`` stays in ``modelpar`` too)
    "modelpar.memory": ["Fit", "MemoryEstimate", "estimate_memory", "search_layouts"],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_each_public_module_exports_exactly_its_names(module: str) -> None:
    imported = importlib.import_module(module)
    assert sorted(imported.__all__) == sorted(SURFACE[module])
    missing = [name for name in SURFACE[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lists {missing} in __all__ but does not define them"


def test_names_exported_twice_are_the_same_object() -> None:
    import modelpar
    import modelpar.checkpoint
    import modelpar.memory

    assert modelpar.estimate_memory is modelpar.memory.estimate_memory
    assert modelpar.MemoryEstimate is modelpar.memory.MemoryEstimate
    assert modelpar.CheckpointKeyError is modelpar.checkpoint.CheckpointKeyError
