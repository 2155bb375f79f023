"""FSDP2's transient buffers in a training step, and the worst single moment of backward.

As ``torch/distributed/fsdp/_fully_shard`` allocates them (torch 2.13): the root unit is not resharded after
forward (``FSDPState._lazy_init`` sets its ``post_forward_mesh_info`` to ``None``), so its parameters stay
gathered, in the compute dtype, from forward through backward. In a unit's backward its unsharded gradients
(compute dtype) exist whole until ``foreach_reduce`` has copied them into the reduce-scatter input, a new
buffer of the unit's padded size in ``reduce_dtype`` (``_fsdp_collectives.foreach_reduce``); both live at once,
beside the unit's gathered parameters. With ``reshard_after_forward=False`` every unit stays gathered between
forward and backward.

The peak per rank is then: persistent state + root gathered + activations kept from forward + the worst single
moment of backward, which is either the loss's gradients or one unit's gathered parameters, unsharded
gradients, reduce-scatter input and (when it is checkpointed) its recomputed activations. Summing the moment on
top of every stored activation over-counts by what backward has already freed (a layer's worth at most).
The sharded gradients are persistent state only under gradient accumulation: with one micro-batch per step,
``zero_grad()`` frees them after the step and backward writes them unit by unit while it frees the activations,
so the peak counts the larger of the two (:attr:`~modelpar.MemoryEstimate.peak`).
"""

from __future__ import annotations

from modelpar.memory._activations import ActivationEstimate

__all__ = ["ROOT", "worst_moment"]

#: The root unit's name in the estimate: parameters under no FSDP unit.
ROOT = "(root)"


def worst_moment(
    gathered: dict[str, int],
    reduce_buffer: dict[str, int],
    activations: ActivationEstimate | None,
    *,
    resharding: bool,
    accumulate: bool,
    unit_extras: dict[str, tuple[tuple[str, int], ...]] | None = None,
    unit_gradients: dict[str, int] | None = None,
    float8_casts: dict[str, int] | None = None,
) -> tuple[str, tuple[tuple[str, int], ...]]:
    """The largest single extra of backward: the loss's gradients, or one unit's backward (name, parts).

    ``unit_extras`` adds parts to a unit's backward: an experts unit's all-to-all buffers under expert parallelism.
    ``unit_gradients``: a unit's unsharded gradients, where they differ from its gathered bytes (weights all-gathered
    in float8). ``float8_casts``: the float8 copies one converted layer of the unit holds in its backward
    (:mod:`modelpar.memory._float8`); they are freed before FSDP2 allocates the reduce-scatter input, so they make a
    moment of their own, beside the unit gathered, its gradients and its recomputed activations.
    """
    recompute = activations.recompute if activations is not None else 0
    grads = unit_gradients if unit_gradients is not None else gathered
    candidates: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    if activations is not None:
        candidates.append(("loss backward", (("logits gradients (fp32)", activations.loss_backward),)))
    for unit, size in gathered.items():
        held = (
            ("unit gathered", size if resharding and unit != ROOT else 0),
            ("unsharded gradients", 0 if accumulate else grads[unit]),
        )
        recomputed = ("recomputed activations", recompute if unit != ROOT else 0)
        parts = (*held, ("reduce-scatter input", reduce_buffer[unit]), recomputed, *(unit_extras or {}).get(unit, ()))
        candidates.append((f"backward of {unit}", parts))
        casts = (float8_casts or {}).get(unit, 0)
        if casts:
            candidates.append((f"float8 backward of {unit}", (*held, recomputed, ("float8 casts (one layer)", casts))))
    if not candidates:
        return "", ()
    return max(candidates, key=lambda c: sum(size for _, size in c[1]))
