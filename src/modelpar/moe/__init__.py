"""Mixture-of-experts on the mesh: expert parallelism (experts split over an expert axis, tokens by all-to-all).

``parallelize_experts`` puts a MoE module (``modelpar.models.moe.MoE`` and modules shaped like it) on the strategy's
mesh; ``ExpertParallel`` is its dispatch (uneven all-to-all, global router statistics); ``expert_parallel_mesh``
and ``expert_fsdp_mesh`` name where experts live. A ``ParallelPlan`` with ``experts=`` patterns does it all
(``modelpar.plans.LLAMA_MOE_PLAN``). See docs/moe.md.
"""

from modelpar.moe._apply import check_moe_module, parallelize_experts
from modelpar.moe._dispatch import ExpertParallel, all_to_all, sum_over_group
from modelpar.moe._layout import expert_fsdp_mesh, expert_parallel_mesh

__all__ = [
    "ExpertParallel",
    "all_to_all",
    "check_moe_module",
    "expert_fsdp_mesh",
    "expert_parallel_mesh",
    "parallelize_experts",
    "sum_over_group",
]
