"""Measured activation memory on CPU: bytes live after a forward and loss, and the bytes autograd saves (in all, or the
most held at once).

``live_after`` runs a step under the CPU profiler with memory profiling and sums every op's own allocations
minus frees: what the step allocated and still holds when it returns (the activations kept for backward, the
logits, the loss; with FSDP2, the root's gathered parameters). It sees inside activation checkpointing, which
hides the tensors it keeps from outer ``saved_tensors_hooks``. ``saved_for_backward`` counts what autograd
packs, each storage once, parameters and buffers excluded: the same figure without checkpointing, and the one
that works under gloo, whose collectives keep buffers alive past the step that a live-bytes count would see.
With compiled layers the live bytes are what inductor's partitioner chose to save (``compile_backend``).
``peak_kept_for_backward`` follows each saved tensor until autograd frees it (and the outputs of chosen modules until
they are dropped): the most held at once during a step, which under a pipeline schedule is the micro-batches in
flight, not every micro-batch of the step.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from warm_python.frozen import freeze

__all__ = [
    "CALIBRATION_MODELS",
    "calibration_model",
    "collect_garbage",
    "estimate_single_process",
    "live_after",
    "measure_single_process",
    "peak_kept_for_backward",
    "saved_for_backward",
]


_frozen = False


def collect_garbage() -> None:
    """Collect the cyclic garbage now, so that none is freed inside a measured step.

    The first call in a process also freezes what survives it (``gc.freeze()``, through ``warm_python.frozen``, which
    keeps the exit quiet): the ~400,000 objects of the libraries imported by then, which every full collection would
    otherwise walk again (0.35-0.45 s a collection on 2 cores, two thirds of a measurement). Later calls walk only
    what was made since. An object frozen then that later becomes garbage in a cycle stays in memory until the
    process ends; its free cannot lower a measurement either.
    """
    global _frozen
    gc.collect()
    if not _frozen:
        freeze()
        _frozen = True


def live_after(step: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes ``step`` allocated and still holds when it returns, its result).

    The profiler also counts frees of memory allocated before the step, which lower the figure; Python's cyclic
    garbage collector runs them at any allocation (an earlier test's models in reference cycles: seen in the whole
    suite, -1.3 MB of 5.9 MB). So the garbage is collected first (:func:`collect_garbage`) and the collector paused
    during the step.
    """
    collect_garbage()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = step()
    finally:
        if enabled:
            gc.enable()
    return sum(event.self_cpu_memory_usage for event in prof.key_averages()), result


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_for_backward(model: nn.Module, step: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes of the distinct storages autograd saves during ``step``, parameters and buffers excluded, result).

    Parameters are leaves that require grad, FSDP2's gathered (unsharded) ones too, and views of them (a weight's
    transpose); activations are not. DTensors count their local tensors.
    """
    owned = {_storage(t).data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:  # checked on the DTensor: its `to_local()` is never a leaf
            return t
        local = t.to_local() if isinstance(t, DTensor) else t
        try:
            key: Any = local.untyped_storage().data_ptr()
            size = local.untyped_storage().nbytes()
        except RuntimeError:  # a tensor subclass without a storage of its own (a collective's pending result)
            key, size = ("subclass", id(t)), local.numel() * local.element_size()
        if key not in owned:
            saved.setdefault(key, size)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = step()
    return sum(saved.values()), result


def _is_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter, FSDP2's gathered ones, a pipeline stage's receive buffer), or a view."""
    base = t._base if t._base is not None else t
    return bool(base.is_leaf and base.requires_grad)


def _key(t: torch.Tensor) -> tuple[Any, int]:
    local = t.to_local() if isinstance(t, DTensor) else t
    try:
        return local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
    except RuntimeError:  # a tensor subclass without a storage of its own (a collective's pending result)
        return ("subclass", id(t)), local.numel() * local.element_size()


class _Live:
    """Storages held, each counted once however many holders it has, and the most bytes held at once."""

    def __init__(self) -> None:
        self.holders: dict[Any, list[int]] = {}
        self.now = self.peak = 0

    def hold(self, key: Any, size: int) -> None:
        entry = self.holders.setdefault(key, [0, size])
        if entry[0] == 0:
            self.now += size
            self.peak = max(self.peak, self.now)
        entry[0] += 1

    def release(self, key: Any) -> None:
        entry = self.holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.holders[key]


class _Saved:
    """What the pack hook hands autograd instead of the tensor: it lives exactly as long as autograd keeps it."""

    __slots__ = ("key", "live", "tensor")

    def __init__(self, tensor: torch.Tensor, key: Any, size: int, live: _Live) -> None:
        self.tensor, self.key, self.live = tensor, key, live
        live.hold(key, size)

    def __del__(self) -> None:
        self.live.release(self.key)


def peak_kept_for_backward(
    model: nn.Module, step: Callable[[], Any], *, outputs: Iterable[nn.Module] = ()
) -> tuple[int, Any]:
    """(the most bytes held at once during ``step`` by autograd's saved tensors and by the outputs of ``outputs``, its
    result).

    Saved tensors count from their pack until autograd frees them (after their backward); parameters, buffers and
    leaves that require grad do not count (as :func:`saved_for_backward`). An output of a module in ``outputs`` counts
    while its Python object lives: a pipeline stage's last output, which ``PipelineStage`` keeps until the micro-batch's
    backward, and the logits, which the schedule keeps to merge them. Each storage counts once.
    """
    owned = {_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
    live = _Live()

    def pack(t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t
        key, size = _key(t)
        return t if key in owned else _Saved(t, key, size, live)

    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and not _is_parameter(t):
                key, size = _key(t)
                live.hold(key, size)
                weakref.finalize(t, live.release, key)

    handles = [module.register_forward_hook(keep) for module in outputs]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            result = step()
    finally:
        for handle in handles:
            handle.remove()
    return live.peak, result


#: Calibration models: modelpar's Llama and two Hugging Face families, sized so activations are not tiny, and
#: mixtures of experts: modelpar's Llama MoE (8 experts, top-2, every other layer a MoE), Qwen3-MoE and Mixtral.
CALIBRATION_MODELS = ("llama", "hf-llama", "hf-qwen3", "llama-moe", "hf-qwen3-moe", "hf-mixtral")
_HF_SIZES: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    tie_word_embeddings=False,
)


def calibration_model(kind: str, seq_len: int, *, meta: bool = False) -> nn.Module:
    """One of :data:`CALIBRATION_MODELS` (on the meta device when ``meta``)."""
    with torch.device("meta" if meta else "cpu"):
        if kind in ("llama", "llama-moe"):
            from modelpar.models import Llama, LlamaConfig

            moe = {"n_experts": 8, "top_k": 2, "moe_hidden": 64, "moe_every": 2} if kind == "llama-moe" else {}
            return Llama(
                LlamaConfig(
                    vocab_size=256,
                    dim=128,
                    n_layers=2,
                    n_heads=4,
                    n_kv_heads=2,
                    ffn_hidden=256,
                    max_seq_len=seq_len,
                    **moe,
                )
            )
        import transformers

        config_cls = {
            "hf-llama": transformers.LlamaConfig,
            "hf-qwen3": transformers.Qwen3Config,
            "hf-qwen3-moe": transformers.Qwen3MoeConfig,
            "hf-mixtral": transformers.MixtralConfig,
        }[kind]
        moe = {
            "hf-qwen3-moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
            "hf-mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
        }.get(kind, {})
        return transformers.AutoModelForCausalLM.from_config(
            config_cls(**{**_HF_SIZES, **moe}, max_position_embeddings=seq_len, head_dim=32)
        )


def measure_single_process(
    kind: str,
    *,
    seq_len: int,
    checkpointing: str,
    dtype: torch.dtype,
    batch: int = 2,
    compile_backend: str | None = None,
) -> int:
    """Bytes live after forward and loss of one step of ``kind`` in ``dtype`` (``F.cross_entropy`` on fp32 logits).

    ``compile_backend``: compile every decoder layer after checkpointing it (``module.compile(backend=...)``), the
    plan's order, and measure the second step (the first compiles). ``"aot_eager_decomp_partition"`` runs
    inductor's decompositions and partitioner without generating code: the same saved tensors as ``"inductor"``
    (``benchmarks/calibrate_estimate.py`` checks both), in seconds instead of about a minute a setting on 2 cores.
    """
    import torch.nn.functional as F

    from modelpar.plans._checkpointing import checkpoint_module

    torch.manual_seed(0)
    model = calibration_model(kind, seq_len).to(dtype)
    layers = model.layers if kind.startswith("llama") else model.model.layers
    for layer in layers:
        if checkpointing != "none":
            checkpoint_module(layer, checkpointing)  # type: ignore[arg-type]
        if compile_backend is not None:
            layer.compile(backend=compile_backend)
    tokens = torch.randint(0, 256, (batch, seq_len))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(tokens) if kind.startswith("llama") else model(input_ids=tokens, use_cache=False).logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))

    if compile_backend is not None:
        from torch import _dynamo

        _dynamo.reset()  # each setting compiles afresh, within dynamo's recompile limit
        _, loss = step()
        aux = getattr(model, "aux_loss", None)  # modelpar's MoE keeps its router losses, and their graph, on the model
        (loss if aux is None else loss + aux).backward()  # frees the first step's graph before the measured one
        model.zero_grad(set_to_none=True)
    # Twice, keeping the larger: the profiler counts every free made inside an op, and a free of memory that was
    # allocated before the step (left by an earlier test in the same process) can only lower the figure. Seen once
    # in the whole suite: -2.9 MB for a step that keeps 6 MB; the second run of the step is then clean.
    return max(live_after(step)[0] for _ in range(2))


def estimate_single_process(
    kind: str, *, seq_len: int, checkpointing: str, dtype: torch.dtype, batch: int = 2, compile: bool = False
) -> int:
    """``estimate_memory``'s stored activations for the same step (``compile``: the plan compiles its layers)."""
    from modelpar import estimate_memory

    model = calibration_model(kind, seq_len, meta=True)
    if kind == "llama":
        from modelpar.plans import LLAMA_PLAN as plan
    elif kind == "llama-moe":
        from modelpar.plans import LLAMA_MOE_PLAN as plan
    else:
        from modelpar.hf import plan_for

        plan = plan_for(model)
    estimate = estimate_memory(
        model,
        plan=plan.replace(activation_checkpointing=checkpointing, compile=compile),
        data_parallel_size=1,
        precision="bf16-true" if dtype == torch.bfloat16 else "32-true",
        seq_len=seq_len,
        micro_batch_size=batch,
    )
    return estimate.stored_activations
