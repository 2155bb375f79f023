"""Context parallelism in a plan: put every attention of the model on sequence shards, or refuse before sharding.

Under ``context_parallel_size > 1`` each rank holds a load-balanced shard of every sequence, and everything but
attention works on it unchanged (projections, norms and MLPs are per token). Attention must see the whole
sequence's keys and values, so the plan swaps each attention module's kernel for
:class:`modelpar.context.ContextParallelAttention`. Two ways in:

- a module that exposes its kernel as an ``attention_kernel`` attribute (``modelpar.models.Llama``'s
  ``Attention``, and models written the same way), named by the plan's ``attention`` patterns;
- a Hugging Face model (it has ``set_attn_implementation``): its attention goes through transformers' registry,
  so the whole model is switched at once (``modelpar.context.use_context_parallel_attention``).

The checks read names and attributes only, so every rank raises the same error before any collective.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from modelpar._mesh.submeshes import context_parallel_mesh
from modelpar.plans._checks import resolve_modules

__all__ = ["KERNEL_ATTRIBUTE", "apply_context_parallel", "attention_modules", "is_hugging_face"]

#: The attribute a module exposes its attention kernel by: ``(query, key, value) -> out`` on
#: ``(batch, heads, seq, head_dim)`` tensors, key/value heads not yet repeated for grouped-query attention.
KERNEL_ATTRIBUTE = "attention_kernel"


def is_hugging_face(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``: its attention is chosen through the config, not module by module."""
    return callable(getattr(model, "set_attn_implementation", None)) and hasattr(model, "config")


def attention_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The names of the attention modules ``patterns`` select, each checked to expose ``attention_kernel``.

    Raises ``ValueError`` when the plan names none (context parallelism would run attention on shards only, which
    is silently wrong), when a pattern matches nothing, or when a matched module has no kernel to replace.
    """
    if not patterns:
        raise ValueError(
            f"Context parallelism needs every attention of {type(model).__name__} to run on sequence shards, but the"
            " plan names no attention modules. Pass `ParallelPlan(attention=('layers.*.attention',), ...)` with the"
            f" modules that expose an `{KERNEL_ATTRIBUTE}` attribute (as `modelpar.models.Llama` does), or set"
            " `context_parallel_size=1`."
        )
    found = resolve_modules(model, "attention", patterns, "attention", "layers.*.attention")
    cannot = [name for name in found if not callable(getattr(model.get_submodule(name), KERNEL_ATTRIBUTE, None))]
    if cannot:
        shown = ", ".join(f"{n} ({type(model.get_submodule(n)).__name__})" for n in cannot[:3])
        raise ValueError(
            f"Context parallelism cannot replace the attention of {shown}: the module has no `{KERNEL_ATTRIBUTE}`"
            " attribute, so its kernel is fixed in its code. Give the module an `attention_kernel(query, key,"
            " value)` attribute that its forward calls (see `modelpar.models.llama.Attention`), or run it with"
            " `context_parallel_size=1`."
        )
    return found


def apply_context_parallel(model: nn.Module, device_mesh: DeviceMesh, patterns: tuple[str, ...]) -> None:
    """Swap in the context-parallel kernel when the mesh has a context-parallel axis of more than one rank."""
    cp_mesh = context_parallel_mesh(device_mesh)
    if cp_mesh is None or cp_mesh.size() == 1:
        return
    from modelpar.context import ContextParallelAttention, use_context_parallel_attention

    if is_hugging_face(model):
        use_context_parallel_attention(model, device_mesh)
        return
    kernel = ContextParallelAttention(device_mesh)
    for name in attention_modules(model, patterns):
        setattr(model.get_submodule(name), KERNEL_ATTRIBUTE, kernel)
