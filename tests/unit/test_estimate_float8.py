"""Float8 training in ``estimate_memory`` (:mod:`modelpar.memory._float8`): counted by hand, and against what CPU steps
under torchao's emulation hold (``Float8Training(recipe, emulate=True)``: the same casts, multiplies in high precision).

The small Llama below has every linear size a multiple of 16, so every layer converts but the LM head. Per block:
wq, wk, wv, wo [32, 32] (4096 elements), w1, w3 [64, 32] (4096), w2 [32, 64] (2048): 10240 in linear layers, plus two
norms of 32; the root: embeddings [64, 32], norm [32], output [64, 32]: 4128.

Measured: the gathered unit on a one-rank FSDP2 mesh (``FSDPModule.unshard``); activations as the other calibrations
(``tests/memory_probe.py``: bytes live when backward starts); the casts of one layer's backward by following every
tensor ops return (a ``TorchDispatchMode``: each storage from its first holder to its last, storages that existed
before excluded), which sees the ops torchao's Python code runs, not what emulation does inside its float8 tensor's
multiply (dequantized fp32 copies that CUDA's ``_scaled_mm`` does not make). Not a whole FSDP2 step: FSDP2 frees its
gathered parameters by resizing their storage to nothing while the tensors live on, which this count cannot see.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memory_probe import calibration_model, collect_garbage, live_after
from modelpar import MemoryEstimate, estimate_memory
from modelpar._cli import main
from modelpar.float8 import Float8Training, convert, float8_layers
from modelpar.memory import search_layouts
from modelpar.memory._float8 import backward_casts
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=64, max_seq_len=128)
LINEAR, NORMS, ROOT = 10240, 64, 4128  # elements per block in linear layers, in its norms; of the root


def small(cfg: LlamaConfig = SMALL) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def estimate(float8: object = None, *, dp: int = 2, tp: int = 1, **kwargs: Any) -> MemoryEstimate:
    kwargs.setdefault("precision", "bf16-mixed")
    return estimate_memory(
        small(), plan=LLAMA_PLAN, data_parallel_size=dp, tensor_parallel_size=tp, float8=float8, **kwargs
    )


# --- what is counted, by hand ------------------------------------------------------------------------------------


def test_float8_all_gather_halves_the_bf16_gathered_weights_and_leaves_the_state_alone():
    plain, tensorwise, rowwise = estimate(), estimate("tensorwise"), estimate("rowwise")
    for e in (tensorwise, rowwise):  # master weights, gradients, optimizer states: high precision
        assert (e.parameters, e.gradients, e.optimizer_states) == (
            plain.parameters,
            plain.gradients,
            plain.optimizer_states,
        )
    assert plain.gathered_unit == plain.unit_gradients == (LINEAR + NORMS) * 2 and plain.largest_unit == "layers.0"
    assert tensorwise.gathered_unit == LINEAR * 1 + NORMS * 2  # float8 weights, bf16 norms
    assert tensorwise.unit_gradients == (LINEAR + NORMS) * 2  # gradients in the compute dtype
    assert rowwise.gathered_unit == plain.gathered_unit  # no float8 all-gather: weights gathered in bf16
    assert "layers.0, bf16 + float8 weights" in str(tensorwise) and "+ float8 weights" not in str(rowwise)


def test_the_all_gather_figures_count_what_each_rank_receives_in_float8_and_without():
    e = estimate("tensorwise")  # 2 ranks: each receives the other's half of every unit
    assert e.float8 is not None and e.float8.gathers_in_float8
    assert e.float8.all_gather == 2 * (LINEAR // 2 * 1 + NORMS // 2 * 2) + ROOT // 2 * 2
    assert e.float8.all_gather_without_float8 == 2 * (LINEAR + NORMS) // 2 * 2 + ROOT // 2 * 2
    assert "all-gathering every unit once: 14.16 KiB received per rank (24.16 KiB without float8" in str(e)


def test_float8_weights_are_gathered_with_fsdp2_padding():
    # 3 ranks: [64, 32] in chunks of 22 rows (66 gathered), [32, ...] in chunks of 11 rows (33 gathered).
    e = estimate("tensorwise", dp=3)
    padded_linear = 4 * 33 * 32 + 2 * 66 * 32 + 33 * 64
    assert e.gathered_unit == padded_linear + 2 * 33 * 2


def test_the_converted_layers_are_those_the_plans_conversion_chooses():
    e = estimate(Float8Training("rowwise"))
    chosen, kept = float8_layers(small(), Float8Training("rowwise"), styles={"output": "output"})
    assert e.float8 is not None and e.float8.converted == len(chosen) == 14
    assert dict(e.float8.kept) == kept == {"output": "the LM head"}
    assert "float8: rowwise, 14 linear layers; kept in high precision: output (the LM head)" in str(e)


def test_a_unit_whose_casts_outweigh_its_reduce_scatter_input_makes_the_worst_moment_without_it():
    # 2 x 128 tokens: w1's output gradient [256, 64] cast twice through fp32 (eager), its input once.
    e = estimate("tensorwise", seq_len=128, micro_batch_size=2)
    casts = backward_casts(256, 32, 64, recipe="tensorwise", weight=True, fused=False)
    assert casts == 256 * 64 * 10  # the second output-gradient cast, with the first beside it
    assert e.moment_name == "float8 backward of layers.0"
    assert dict(e.moment) == {
        "unit gathered": LINEAR + NORMS * 2,
        "unsharded gradients": (LINEAR + NORMS) * 2,
        "recomputed activations": 0,
        "float8 casts (one layer)": casts,
    }
    plain = estimate(seq_len=128, micro_batch_size=2)
    assert e.stored_activations == plain.stored_activations  # eager: a float8 layer saves what nn.Linear saves


def test_compiled_float8_layers_keep_neither_norm_output_nor_the_swiglu_product():
    kwargs = {"seq_len": 128, "micro_batch_size": 2, "precision": "bf16-true"}
    plan = LLAMA_PLAN.replace(compile=True)
    compiled = estimate_memory(small(), plan=plan, data_parallel_size=1, **kwargs)
    rows, a = 256, 2
    for recipe, saved in (("tensorwise", 2 * rows * (2 * 32 * a + 64 * a)), ("rowwise_with_gw_hp", 0)):
        e = estimate_memory(small(), plan=plan, data_parallel_size=1, float8=recipe, **kwargs)
        assert compiled.stored_activations - e.stored_activations == saved
        assert e.float8 is not None and e.float8.activations_saved == saved
    # Under checkpointing the compiled layers keep their inputs: nothing to save.
    full = plan.replace(activation_checkpointing="full")
    assert (
        estimate_memory(
            small(), plan=full, data_parallel_size=1, float8="tensorwise", **kwargs
        ).float8.activations_saved
        == 0
    )


def test_compiled_casts_are_fused_float8_copies():
    assert backward_casts(256, 32, 64, recipe="tensorwise", weight=True, fused=True) == 2 * 256 * 64 + 256 * 32
    assert backward_casts(256, 32, 64, recipe="rowwise", weight=False, fused=True) == 2 * 256 * 64 + 32 * 64 + 256 * 32
    assert backward_casts(256, 32, 64, recipe="rowwise_with_gw_hp", weight=False, fused=True) == 256 * 64 + 32 * 64


def test_tensor_parallel_casts_count_the_local_features():
    one = estimate("tensorwise", dp=1, seq_len=128, micro_batch_size=2)
    two = estimate("tensorwise", dp=1, tp=2, seq_len=128, micro_batch_size=2)
    assert one.float8 is not None and two.float8 is not None
    # w1 colwise: out features 64 -> 32 per rank; w2 rowwise: in features 64 -> 32. FSDP2 shards over one rank, so
    # the weights are gathered in bf16 and the backward casts them too.
    assert two.float8.casts == backward_casts(256, 32, 32, recipe="tensorwise", weight=False, fused=False)
    assert two.float8.casts < one.float8.casts


def test_pipeline_stages_gather_their_float8_weights_and_cast_in_their_backward():
    e = estimate("tensorwise", pipeline_parallel_size=2, seq_len=128, micro_batch_size=4, pipeline_microbatches=2)
    assert e.pipeline is not None and e.float8 is not None
    assert e.gathered_unit == LINEAR + NORMS * 2  # a block, each stage's only one
    assert e.float8.casts == backward_casts(256, 32, 64, recipe="tensorwise", weight=True, fused=False)


def test_search_takes_float8_and_lists_it():
    fits, tried = search_layouts(
        small(), LLAMA_PLAN, world_size=4, gpu_memory=2**30, seq_len=128, micro_batch_size=2, float8="tensorwise"
    )
    assert fits and tried and all(fit.estimate.float8 is not None for fit in fits)


# --- errors ------------------------------------------------------------------------------------------------------


def test_an_unknown_recipe_is_refused_with_the_recipes():
    with pytest.raises(ValueError, match=r"estimate_memory\(float8='fp4'\) is not a float8 recipe. Use one of"):
        estimate("fp4")


def test_a_float8_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match=r"estimate_memory\(float8=...\) must be a recipe name .* but got int"):
        estimate(8)


def test_a_float8_argument_that_disagrees_with_the_plans_is_refused():
    with pytest.raises(ValueError, match=r"and its plan's `float8=Float8Training\(recipe='rowwise'.* disagree"):
        estimate_memory(small(), plan=LLAMA_PLAN.replace(float8="rowwise"), data_parallel_size=1, float8="tensorwise")
    agreeing = estimate_memory(
        small(), plan=LLAMA_PLAN.replace(float8="rowwise"), data_parallel_size=1, float8="rowwise"
    )
    assert agreeing.float8 is not None and agreeing.float8.recipe == "rowwise"


def test_chosen_layers_the_kernels_cannot_take_at_this_tensor_parallel_size_are_refused():
    model = small(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=64))
    spec = Float8Training("tensorwise", modules=("layers.*.attention.wk",))
    estimate_memory(model, plan=LLAMA_PLAN, data_parallel_size=1, tensor_parallel_size=2, float8=spec)  # 16 per rank
    with pytest.raises(ValueError, match=r"layers.0.attention.wk: out_features=32 \(8 per tensor-parallel rank\)"):
        estimate_memory(model, plan=LLAMA_PLAN, data_parallel_size=1, tensor_parallel_size=4, float8=spec)


def test_search_skips_tensor_parallel_sizes_the_chosen_layers_cannot_take():
    model = small(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=64))
    spec = Float8Training("tensorwise", modules=("layers.*.attention.wk",))
    fits, _ = search_layouts(model, LLAMA_PLAN, world_size=4, gpu_memory=2**30, seq_len=128, float8=spec)
    assert {fit.tensor_parallel for fit in fits} == {1, 2}  # tp 4 leaves 8 features per rank


def test_fused_experts_chosen_for_float8_are_refused():
    cfg = LlamaConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=64, n_experts=4, top_k=2, moe_hidden=32
    )
    spec = Float8Training("rowwise", modules=("layers.*.moe.experts",))
    with pytest.raises(NotImplementedError, match=r"fused weights .* grouped GEMMs"):
        estimate_memory(small(cfg), plan=LLAMA_MOE_PLAN, data_parallel_size=1, float8=spec)


def test_cli_takes_a_recipe_and_refuses_others(capsys):
    config = json.dumps({"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 64})
    assert main(["estimate", "--llama", config, "--dp", "2", "--float8", "tensorwise", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "float8: tensorwise, 14 linear layers" in out and "float8 backward of layers.0" in out
    with pytest.raises(SystemExit):
        main(["estimate", "--llama", config, "--float8", "fp4"])
    assert "argument --float8: invalid choice: 'fp4'" in capsys.readouterr().err


# --- against measurement (torchao's emulation on CPU) --------------------------------------------------------------

#: The estimate needs no torchao (it reads names and shapes); the measurements run torchao's layers.
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, bytes) of what ``t`` holds: its storage, or a wrapper subclass's inner tensors' (torchao's float8)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) not in (torch.Tensor, nn.Parameter) and callable(flatten):
        names, _ = flatten()
        inner = [getattr(t, name) for name in names]
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


class HeldBytes(TorchDispatchMode):
    """The most bytes held at once by tensors that ops return inside the mode, each storage once, from its first holder
    to its last (PyTorch keeps a tensor's Python object while autograd holds it), those of ``before`` excluded."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.before = {key for t in before for key, _ in _storages(t)}
        self.holders: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.holders[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for key, size in _storages(t):
                if key in self.before or size == 0:
                    continue
                entry = self.holders.setdefault(key, [0, size])
                if entry[0] == 0:
                    self.now += size
                    self.peak = max(self.peak, self.now)
                entry[0] += 1
                weakref.finalize(t, self._release, key)
        return out


def peak_held(step: Callable[[], object], before: list[torch.Tensor]) -> int:
    collect_garbage()
    gc.disable()  # no earlier test's garbage freed inside the step
    try:
        with HeldBytes(before) as held:
            step()
    finally:
        gc.enable()
    return held.peak


@needs_torchao
@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [("tensorwise", torch.float32), ("rowwise", torch.bfloat16), ("rowwise_with_gw_hp", torch.bfloat16)],
    ids=str,
)
def test_a_layers_backward_holds_the_casts_counted_beside_its_input_gradient(recipe, dtype):
    tokens, in_features, out_features = 512, 256, 128
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(dtype)
    convert(model, Float8Training(recipe, emulate=True, all_gather=False), device_type="cpu")
    x = torch.randn(tokens, in_features, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, out_features, dtype=dtype)
    y = model(x)
    measured = peak_held(lambda: y.backward(grad), [*model.parameters(), x, grad])
    counted = backward_casts(tokens, in_features, out_features, recipe=recipe, weight=False, fused=False)
    # tensorwise and rowwise cast for the weight gradient beside the input gradient (which nn.Linear's backward makes
    # too); rowwise_with_gw_hp casts only before it exists.
    beside = tokens * in_features * dtype.itemsize if recipe != "rowwise_with_gw_hp" else 0
    scales = 4 * 2 * (tokens + in_features + out_features)  # fp32 scales: rowwise, one per row of each cast
    assert counted <= measured - beside <= counted + scales


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    finally:
        dist.destroy_process_group()


@needs_torchao
@pytest.mark.parametrize(("recipe", "all_gather"), [("tensorwise", True), ("tensorwise", None), ("rowwise", None)])
def test_fsdp2_gathers_the_unit_the_estimate_counts(one_rank_mesh, recipe, all_gather):
    """On one rank the tensorwise default gathers in bf16 (nothing to gather, so no float8 all-gather), and
    ``all_gather=True`` gathers in float8 anyway: the estimate counts what FSDP2 gathers in each case."""
    plan = LLAMA_PLAN.replace(float8=Float8Training(recipe, all_gather=all_gather, emulate=True))
    model = plan(calibration_model("llama", 128).to(torch.bfloat16), one_rank_mesh)
    layer = model.layers[0]
    measured, _ = live_after(layer.unshard)
    layer.reshard()
    e = estimate_memory(
        calibration_model("llama", 128, meta=True), plan=plan, data_parallel_size=1, precision="bf16-true"
    )
    assert e.largest_unit == "layers.0"
    assert e.float8 is not None and e.float8.gathers_in_float8 is bool(all_gather)
    scales = 4 * 7 if all_gather else 0  # the float8 weights' fp32 scales, not counted
    assert e.gathered_unit + scales <= measured <= e.gathered_unit + scales + 8
    if not all_gather:
        forced = estimate_memory(
            calibration_model("llama", 128, meta=True),
            plan=LLAMA_PLAN.replace(float8=Float8Training("tensorwise", all_gather=True, emulate=True)),
            data_parallel_size=1,
            precision="bf16-true",
        )
        assert forced.gathered_unit < e.gathered_unit  # float8 weights, one byte an element


def measure_activations(recipe: str | None, checkpointing: str, dtype: torch.dtype, backend: str | None = None) -> int:
    from modelpar.plans._checkpointing import checkpoint_module

    torch.manual_seed(0)
    model = calibration_model("llama", 128).to(dtype)
    if recipe is not None:
        convert(model, Float8Training(recipe, emulate=True, all_gather=False), device_type="cpu")  # type: ignore[arg-type]
    for layer in model.layers:
        if checkpointing != "none":
            checkpoint_module(layer, checkpointing)  # type: ignore[arg-type]
        if backend is not None:
            layer.compile(backend=backend)
    tokens = torch.randint(0, 256, (2, 128))

    def step() -> tuple[torch.Tensor, torch.Tensor]:  # the logits stay alive, as in a training step
        logits = model(tokens)
        return logits, F.cross_entropy(logits.reshape(-1, 256).float(), tokens.reshape(-1))

    if backend is not None:
        torch._dynamo.reset()
        step()[1].backward()  # compiles
        model.zero_grad(set_to_none=True)
    return max(live_after(step)[0] for _ in range(2))


def estimate_activations(recipe: str | None, checkpointing: str, dtype: torch.dtype, compile: bool = False) -> int:
    plan = LLAMA_PLAN.replace(activation_checkpointing=checkpointing, compile=compile, float8=recipe)
    precision = "bf16-true" if dtype == torch.bfloat16 else "32-true"
    e = estimate_memory(
        calibration_model("llama", 128, meta=True),
        plan=plan,
        data_parallel_size=1,
        precision=precision,
        seq_len=128,
        micro_batch_size=2,
    )
    return e.stored_activations


@needs_torchao
@pytest.mark.parametrize(
    ("recipe", "checkpointing", "dtype"),
    [("tensorwise", "none", torch.bfloat16), ("rowwise", "selective", torch.float32)],
    ids=str,
)
def test_eager_float8_layers_keep_what_high_precision_ones_keep(recipe, checkpointing, dtype):
    measured = measure_activations(recipe, checkpointing, dtype)
    assert measured == measure_activations(None, checkpointing, dtype)  # exactly: the input, saved in high precision
    estimated = estimate_activations(recipe, checkpointing, dtype)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


@needs_torchao
def test_compiled_float8_layers_keep_what_the_estimate_counts():
    measured = measure_activations("tensorwise", "none", torch.bfloat16, backend="aot_eager_decomp_partition")
    estimated = estimate_activations("tensorwise", "none", torch.bfloat16, compile=True)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)
    assert estimated < estimate_activations(None, "none", torch.bfloat16, compile=True)
