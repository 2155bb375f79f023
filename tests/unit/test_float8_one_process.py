"""Float8 training (``modelpar.float8``) in one process: the spec, the refusals, which layers convert, the decisions
taken only on CUDA, plain state dicts, and float8's loss curve against bf16's over tens of steps.

torchao's float8 emulation (``emulate=True``) runs the same casts and scales on CPU, with high-precision multiplies.
The multi-process parity with one process, on every layout, is tests/distributed/test_float8.py.
"""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from modelpar import ModelParallelStrategy
from modelpar.float8 import (
    FLOAT8_CAPABILITY,
    RECIPES,
    Float8Training,
    check_float8_device,
    convert,
    float8_layers,
)
from modelpar.float8._parallel import float8_input_cast, float8_style
from modelpar.float8._spec import Float8Recipe
from modelpar.float8._state import plain_tensor
from modelpar.float8._torchao import check_torchao_version
from modelpar.models import Llama, LlamaConfig
from modelpar.models.moe import MoE
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN, ParallelPlan
from modelpar.plans._checkpointing import SAVED_OPS

# Every size a multiple of 16, as the float8 kernels need (the head's 64 outputs too: it stays high precision anyway).
CFG = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=16)
PROJECTIONS = [f"layers.{i}.{p}" for i in range(2) for p in ("attention.wq", "attention.wk", "attention.wv")]


def meta_llama(cfg: LlamaConfig = CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


# -- the spec -------------------------------------------------------------------------------------------------------
def test_a_recipe_name_is_shorthand_for_its_spec_and_every_recipe_is_offered():
    assert ParallelPlan(float8="rowwise").float8 == Float8Training("rowwise")
    assert LLAMA_PLAN.replace(float8=Float8Training("tensorwise", emulate=True)).float8.emulate
    assert sorted(RECIPES) == ["rowwise", "rowwise_with_gw_hp", "tensorwise"]
    assert Float8Training("tensorwise").gathers_in_float8
    assert not Float8Training("tensorwise", all_gather=False).gathers_in_float8
    assert not Float8Training("rowwise").gathers_in_float8
    assert ModelParallelStrategy(float8="rowwise")._core.options.float8 == Float8Training("rowwise")


@pytest.mark.parametrize(
    ("spec", "shard_size", "gathers"),
    [
        (Float8Training("tensorwise"), 1, False),  # one GPU, or TP alone: nothing to gather (torchtitan's rule)
        (Float8Training("tensorwise"), 2, True),
        (Float8Training("tensorwise"), None, True),  # not known (convert given only a device type): as before
        (Float8Training("tensorwise", all_gather=True), 1, True),
        (Float8Training("tensorwise", all_gather=False), 8, False),
        (Float8Training("rowwise"), 8, False),
    ],
)
def test_the_float8_all_gather_is_on_by_default_only_where_fsdp2_shards_over_several_ranks(spec, shard_size, gathers):
    assert spec.gathers_in_float8_over(shard_size) is gathers


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ParallelPlan(float8="fp8"), ValueError, r"float8='fp8'\) is not a float8 recipe.*'tensorwise'"),
        (lambda: ParallelPlan(float8=8), TypeError, r"must be a recipe name .* but got int"),
        (
            lambda: Float8Training("rowwise", all_gather=True),
            ValueError,
            r"only the 'tensorwise' recipe can all-gather",
        ),
        (lambda: Float8Training("per-tensor"), ValueError, r"recipe='per-tensor'\) is not a float8 recipe"),
        (lambda: Float8Training(emulate="yes"), TypeError, r"emulate='yes'\) must be a bool"),
        (lambda: Float8Training(modules="layers.*"), TypeError, r"not a single str"),
        (lambda: ModelParallelStrategy(float8="int8"), ValueError, r"ModelParallelStrategy\(float8='int8'\)"),
    ],
)
def test_bad_specs_are_refused_when_made_with_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_missing_or_old_torchao_names_the_extra_to_install():
    with pytest.raises(
        ModuleNotFoundError, match=r"needs torchao >= 0\.18, which is not installed.*modelpar\[float8\]"
    ):
        check_torchao_version(None)
    with pytest.raises(ImportError, match=r"torchao 0\.17\.1 is installed.*modelpar\[float8\]"):
        check_torchao_version("0.17.1")
    check_torchao_version("0.18.0+cu130")
    check_torchao_version("0.19.0.dev20261101")


@pytest.mark.parametrize(
    ("device_type", "capability", "emulate", "refused"),
    [
        ("cpu", None, False, "the 'cpu' device"),
        ("cpu", None, True, None),
        ("cuda", (8, 0), False, "compute capability 8.0"),  # A100: no float8 multiplies
        ("cuda", (8, 0), True, None),
        ("cuda", FLOAT8_CAPABILITY, False, None),  # L4 / L40
        ("cuda", (9, 0), False, None),  # H100 / H200
        ("cuda", (10, 0), False, None),  # B200
    ],
)
def test_float8_kernels_are_required_unless_emulating(device_type, capability, emulate, refused):
    if refused is None:
        check_float8_device(device_type, capability, emulate=emulate)
        return
    with pytest.raises(RuntimeError, match=rf"{refused} does not have.*emulate=True"):
        check_float8_device(device_type, capability, emulate=emulate)


def test_a_plan_with_float8_on_a_device_without_kernels_is_refused_before_anything_is_converted():
    model = meta_llama()
    with pytest.raises(RuntimeError, match=r"'cpu' device does not have"):
        convert(model, Float8Training("rowwise"), device_type="cpu")
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


# -- which layers ---------------------------------------------------------------------------------------------------
def test_by_default_every_linear_layer_converts_but_the_lm_head_and_what_the_kernels_cannot_take():
    chosen, kept = float8_layers(meta_llama(), Float8Training())
    assert kept == {"output": "the LM head"}
    assert len(chosen) == 14 and set(PROJECTIONS) <= set(chosen)
    odd = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=16)
    _, kept = float8_layers(meta_llama(odd), Float8Training())
    assert kept["layers.0.feed_forward.w1"] == "out_features=72 is not a multiple of 16"
    assert kept["layers.0.feed_forward.w2"] == "in_features=72 is not a multiple of 16"


def test_sizes_count_per_tensor_parallel_rank():
    narrow = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_hidden=128, max_seq_len=16)
    model = meta_llama(narrow)
    styles, _ = LLAMA_PLAN._resolve(model, 4)
    _, kept = float8_layers(model, Float8Training(), styles=styles, tensor_parallel_size=4)
    # wk/wv: 4 KV heads x 8 = 32 outputs, 8 per rank of 4; wq and the MLP split into multiples of 16.
    assert kept["layers.0.attention.wk"] == "out_features=32 (8 per tensor-parallel rank) is not a multiple of 16"
    assert "layers.0.attention.wq" not in kept
    assert not float8_layers(model, Float8Training(), styles=styles, tensor_parallel_size=2)[1].get(
        "layers.0.attention.wk"
    )
    with pytest.raises(ValueError, match=r"attention\.wk: out_features=32 \(8 per tensor-parallel rank\)"):
        LLAMA_PLAN.replace(float8=Float8Training(modules=("layers.*.attention",))).check(meta_llama(narrow), 4)


def test_chosen_modules_take_their_linear_layers_and_fused_experts_are_refused_by_name():
    chosen, _ = float8_layers(meta_llama(), Float8Training(modules=("layers.*.attention",)))
    assert chosen == [f"layers.{i}.attention.{p}" for i in range(2) for p in ("wq", "wk", "wv", "wo")]
    chosen, _ = float8_layers(meta_llama(), Float8Training(modules={nn.Linear}))
    assert "output" in chosen  # named, so converted
    moe_cfg = dataclasses.replace(CFG, n_experts=4, top_k=2)
    model = meta_llama(moe_cfg)
    chosen, _ = float8_layers(model, Float8Training(), experts=LLAMA_MOE_PLAN.experts)
    assert not any(".moe." in n for n in chosen), "routers and experts stay high precision"
    moe = next(n for n, m in model.named_modules() if isinstance(m, MoE))
    with pytest.raises(NotImplementedError, match=r"fused weights .* grouped GEMMs.*torchao\.prototype\.moe_training"):
        float8_layers(model, Float8Training(modules=(f"{moe}.experts",)))


def test_a_pattern_that_matches_nothing_is_refused_with_the_names():
    with pytest.raises(ValueError, match=r"float8\.modules"):
        float8_layers(meta_llama(), Float8Training(modules=("blocks.*",)))


# -- the strategy option --------------------------------------------------------------------------------------------
def test_the_strategy_option_goes_to_its_plan_and_is_refused_for_a_function_of_ones_own():
    strategy = ModelParallelStrategy(LLAMA_PLAN, float8="rowwise")
    assert strategy._core.parallelize_fn.float8 == Float8Training("rowwise")

    def my_parallelize(model, mesh):
        return model

    with pytest.raises(ValueError, match=r"function of your own.*modelpar\.float8\.convert\(model"):
        ModelParallelStrategy(my_parallelize, float8="rowwise")
    with pytest.raises(ValueError, match=r"disagree\. Set float8 in one place"):
        ModelParallelStrategy(LLAMA_PLAN.replace(float8="tensorwise"), float8="rowwise")


def test_convert_reads_the_shard_size_off_the_strategys_mesh(caplog):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        by_default, forced = Llama(CFG), Llama(CFG)
        with caplog.at_level("INFO"):
            convert(by_default, Float8Training("tensorwise", emulate=True), device_mesh=mesh)
        convert(forced, Float8Training("tensorwise", all_gather=True, emulate=True), device_mesh=mesh)
        assert not by_default.layers[0].attention.wq.config.enable_fsdp_float8_all_gather
        assert forced.layers[0].attention.wq.config.enable_fsdp_float8_all_gather
        assert "float8 (tensorwise, all-gathered in high precision: FSDP2 shards over 1 rank" in caplog.text
        with pytest.raises(ValueError, match=r"convert\(device_type='cuda'\) disagrees with its `device_mesh`.*'cpu'"):
            convert(Llama(CFG), Float8Training("tensorwise", emulate=True), device_type="cuda", device_mesh=mesh)
    finally:
        dist.destroy_process_group()
    with pytest.raises(TypeError, match=r"convert\(\) needs `device_mesh`.*or `device_type`"):
        convert(Llama(CFG), Float8Training("tensorwise", emulate=True))


# -- what runs only on CUDA, decided on CPU -------------------------------------------------------------------------
def test_float8_collectives_are_chosen_only_where_the_backend_moves_float8():
    float8 = Llama(CFG)
    convert(float8, Float8Training("tensorwise", emulate=True), device_type="cpu")
    wq = float8.layers[0].attention.wq
    style = float8_style(wq, ColwiseParallel(), "nccl")
    assert type(style).__name__ == "Float8ColwiseParallel"
    assert (
        type(float8_style(float8.layers[0].attention.wo, RowwiseParallel(), "nccl")).__name__ == "Float8RowwiseParallel"
    )
    assert type(float8_style(wq, ColwiseParallel(), "gloo")) is ColwiseParallel  # gloo: "Invalid scalar type"
    assert float8_input_cast([wq, float8.layers[0].attention.wk], "nccl") is not None
    assert float8_input_cast([wq], "gloo") is None
    rowwise = Llama(CFG)
    convert(rowwise, Float8Training("rowwise", emulate=True), device_type="cpu")
    assert type(float8_style(rowwise.layers[0].attention.wq, ColwiseParallel(), "nccl")) is ColwiseParallel
    assert float8_input_cast([rowwise.layers[0].attention.wq], "nccl") is None
    assert float8_input_cast([wq, float8.output], "nccl") is None  # the head consumes it in high precision


def test_selective_checkpointing_keeps_float8_multiplies():
    assert torch.ops.aten._scaled_mm.default in SAVED_OPS


# -- checkpoints stay precision-free --------------------------------------------------------------------------------
def test_a_float8_models_state_dict_is_plain_tensors_that_load_without_torchao(tmp_path):
    torch.manual_seed(0)
    model = Llama(CFG)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model, Float8Training("tensorwise", emulate=True), device_type="cpu")
    wrapped = model.layers[0].attention.wq.weight
    assert plain_tensor(wrapped) is not wrapped  # torchao's cast wrapper, for the float8 all-gather
    state = model.state_dict()
    assert {type(v) for v in state.values()} == {torch.Tensor}
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = tmp_path / "float8.pt"
    path.write_bytes(buffer.getvalue())
    code = (
        "import sys, torch; sys.modules['torchao'] = None\n"  # no torchao: an import of it would fail
        f"state = torch.load({str(path)!r}, weights_only=True); print(len(state))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(reference))
    plain = Llama(CFG)
    plain.load_state_dict(state)
    model.load_state_dict({k: v * 2 for k, v in plain.state_dict().items()})  # into the wrapper, in place
    assert torch.equal(
        model.state_dict()["layers.0.attention.wq.weight"], 2 * reference["layers.0.attention.wq.weight"]
    )


# -- float8 against bf16, over tens of steps ------------------------------------------------------------------------
STEPS = 20
#: The stated tolerance (docs/float8.md): each step's loss within 2% of bf16 training's, relative.
LOSS_TOLERANCE = 0.02


def _losses(recipe: Float8Recipe | None) -> torch.Tensor:
    torch.manual_seed(0)
    model = Llama(CFG)
    if recipe is not None:
        convert(model, Float8Training(recipe, emulate=True), device_type="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(STEPS):
        start, step = torch.randint(0, 64, (8, 1), generator=g), torch.randint(1, 5, (8, 1), generator=g)
        tokens = (start + step * torch.arange(13)) % CFG.vocab_size
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_float8_training_follows_bf16_training_within_the_stated_tolerance():
    bf16 = _losses(None)
    assert bf16[-1] < 0.6 * bf16[0]  # it learns, so the curves are compared while they move
    for recipe in ("tensorwise", "rowwise"):
        float8 = _losses(recipe)  # type: ignore[arg-type]
        relative = ((float8 - bf16).abs() / bf16).max().item()
        assert 0 < relative < LOSS_TOLERANCE, f"{recipe}: {relative:.4f}"
