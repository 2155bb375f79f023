"""Float8 training on real process groups, each layout against one process with the same float8 recipe.

One spawn of 4 processes runs the grid (torchao's emulation: the same casts and scales, high-precision multiplies):
tensorwise at 2x2 with sequence parallelism and accumulation (FSDP2 all-gathers in float8, the scales refreshed by
the strategy), rowwise at 2x2, tensorwise under HSDP with selective checkpointing, tensorwise with compiled blocks, pp=2 x dp=2, the no-code
strategy's ``float8`` option (Fabric and the Trainer), rowwise with context and expert parallelism; a checkpoint written under float8
loaded into a model without it at another layout and back; a Hugging Face model in float8 from
``load_pretrained`` to ``save_pretrained``. The test process then reads the checkpoints with torchao unimportable.

The reference: tensorwise scales an activation by its largest value over what one rank multiplies at once (its
data-parallel slice, its micro-batch), so one process reproduces a layout by running those slices one after the
other, accumulating gradients: the same init, the same data, the same scales. Rowwise scales per token, so the
split does not matter; the reference is the same.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.distributed.tensor import DTensor

from harness import PG_TIMEOUT, run_distributed
from modelpar import ModelParallelStrategy
from modelpar.float8 import Float8Training, convert
from modelpar.models import Llama, LlamaConfig
from modelpar.pipeline._run import pipeline_of
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN, ParallelPlan
from parity import adamw, shard_difference

# Every size a multiple of 16 per tensor-parallel rank of 2 (the LM head stays high precision).
CFG = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=16)
MOE_CFG = dataclasses.replace(CFG, n_experts=4, aux_loss_coef=0.0, z_loss_coef=0.0)
TENSORWISE = Float8Training("tensorwise", emulate=True)
ROWWISE = Float8Training("rowwise", emulate=True)
#: SGD, not AdamW: AdamW divides by the root of near-zero second moments, which turns float32 rounding differences
#: of 1e-9 in a gradient into weight differences of 1e-5; float8's 3-bit mantissa then rounds a few weights or
#: activations to the next float8 value, 6% away, and the runs part. SGD keeps weights as close as the gradients.
BATCH, SEQ, STEPS, LR = 8, 12, 3, 0.5
#: Losses, norms, gradients and weights agree to float32 rounding.
LOSS_TOL, PARAM_TOL = 2e-5, 2e-5
#: After the first update under tensor parallelism, tensorwise runs part by float8 roundings: the TP ranks sum
#: partial gradients in another order than one process (differences of 1e-8), the weights then differ by 1e-7, and
#: tensorwise scales (448 / the weight's largest value, not rounded to a power of 2) move with them, so a few
#: elements round to the next float8 value, 1/8 away. The first step is still exact; later ones agree to this.
TENSORWISE_TP_TOL = 5e-3


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        start, step = torch.randint(0, 64, (BATCH, 1), generator=g), torch.randint(1, 5, (BATCH, 1), generator=g)
        tokens = (start + step * torch.arange(SEQ + 1)) % CFG.vocab_size
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _fabric(parallelize_fn: Any = LLAMA_PLAN, **kwargs: Any) -> Fabric:
    fabric = Fabric(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(parallelize_fn, timeout=PG_TIMEOUT, **kwargs),
    )
    fabric.launch()
    return fabric


def _model(fabric: Fabric, cfg: LlamaConfig = CFG) -> Any:
    torch.manual_seed(0)  # the meta-device model is materialized with one process's draws
    with fabric.init_module(empty_init=True):
        model = Llama(cfg)
    return fabric.setup_module(model)


def _reference(spec: Float8Training, cfg: LlamaConfig = CFG) -> Llama:
    torch.manual_seed(0)
    ref = Llama(cfg)
    convert(ref, spec, device_type="cpu", experts=LLAMA_MOE_PLAN.experts if cfg.n_experts else ())
    return ref


def _worst(model: Any, ref: torch.nn.Module, what: str = "param") -> float:
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.module.named_parameters():
        ours, theirs = (p.grad, ref_params[name].grad) if what == "grad" else (p, ref_params[name])
        worst = max(worst, shard_difference(ours, theirs))  # this rank's shards, no collective
    return worst


def _scales_are_current(module: torch.nn.Module) -> bool:
    """Every float8-gathered weight's precomputed scale is the one its current values give (torchao's formula)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    checked = 0
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, DTensor) and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor):
            amax = torch.clamp(_full(weight).abs().max(), 1e-12).to(torch.float64)
            want = (torch.finfo(torch.float8_e4m3fn).max / amax).to(torch.float32)
            got = weight._local_tensor._precomputed_scale
            if got is None or not torch.allclose(got, want, rtol=1e-6):
                return False
            checked += 1
    return checked > 0


def _train(
    spec: Float8Training,
    *,
    plan: ParallelPlan | None = LLAMA_PLAN,
    cfg: LlamaConfig = CFG,
    chunks: int = 1,
    pipeline: bool = False,
    context: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """Steps of the float8 model on 4 ranks and of one float8 process on the same batches; the worst differences.

    ``chunks``: forward/backward calls per rank and step (accumulation); the pipeline's micro-batches likewise."""
    from modelpar.context import cross_entropy, shard_batch

    fabric = _fabric(None, float8=spec, **kwargs) if plan is None else _fabric(plan.replace(float8=spec), **kwargs)
    mesh = fabric.strategy.device_mesh
    dp, rank = mesh["data_parallel"].size(), mesh["data_parallel"].get_local_rank()
    model = _model(fabric, cfg)
    ref = _reference(spec, cfg)
    out: dict[str, Any] = {"init": _worst(model, ref), "loss": 0.0, "grad": 0.0, "norm": 0.0, "first": {}}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    per = BATCH // dp
    for x, y in _batches():
        xs, ys = x[per * rank : per * (rank + 1)], y[per * rank : per * (rank + 1)]
        if pipeline:
            loss = fabric.strategy.pipeline_step(model, xs, ys, _loss)
        elif context:
            batch = shard_batch({"input_ids": xs, "labels": ys}, mesh)
            local = cross_entropy(model(batch["input_ids"], batch["position_ids"]), batch["labels"], mesh)
            fabric.backward(local)
            loss = fabric.all_reduce(local.detach().clone())
        else:
            local = torch.zeros(())
            for xc, yc in zip(xs.chunk(chunks), ys.chunk(chunks), strict=True):
                part = _loss(model(xc), yc) / chunks
                fabric.backward(part)
                local = local + part.detach()
            loss = fabric.all_reduce(local)
        pieces = list(zip(x.chunk(dp * chunks), y.chunk(dp * chunks), strict=True))  # each rank's slices, in rank order
        ref_loss = torch.zeros(())
        for xc, yc in pieces:
            part = _loss(ref(xc), yc) / len(pieces)
            part.backward()
            ref_loss = ref_loss + part.detach()
        out["loss"] = max(out["loss"], abs(float(loss) - float(ref_loss)))
        if not pipeline:
            out["grad"] = max(out["grad"], _worst(model, ref, "grad"))
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        out["norm"] = max(out["norm"], abs(float(norm) - float(ref_norm)))
        if not out["first"]:
            out["first"] = {k: out[k] for k in ("loss", "grad", "norm")}
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    out["param"] = _worst(model, ref)
    roots = pipeline_of(model.module).modules if pipeline else [model.module]
    with torch.no_grad():  # the forward after the last update: the scales follow the weights
        if pipeline:
            fabric.strategy.pipeline_eval(model, xs, ys, _loss)
        elif not context:
            model(xs)
    refreshes = [getattr(root, "_modelpar_float8_scales", None) for root in roots]
    out["refreshes"] = [r.refreshes for r in refreshes if r is not None]
    out["scales_current"] = all(_scales_are_current(root) for root in roots) if out["refreshes"] else None
    out["float8_layers"] = sum(type(m).__name__ == "Float8Linear" for m in model.module.modules())
    out["state_types"] = sorted(
        {type(v.to_local() if isinstance(v, DTensor) else v).__name__ for v in model.module.state_dict().values()}
    )
    return out


def _compiled() -> dict[str, Any]:
    """``compile=True`` with tensorwise: the blocks are compiled with the scale refresh's hooks on them. The
    aot_eager backend (Dynamo and AOTAutograd with fake tensors, no code generation) keeps it seconds."""
    original = torch.nn.Module.compile

    def aot_eager(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, backend="aot_eager", **kwargs)

    with mock.patch.object(torch.nn.Module, "compile", aot_eager):
        return _train(TENSORWISE, plan=LLAMA_PLAN.replace(compile=True), data_parallel_size=4, tensor_parallel_size=1)


def _checkpoints(folder: str) -> dict[str, float]:
    """Float8 tensorwise at 2x2 -> a distributed checkpoint -> no float8 at 4x1 -> a full file -> rowwise at 2x2."""
    fabric = _fabric(LLAMA_PLAN.replace(float8=TENSORWISE), data_parallel_size=2, tensor_parallel_size=2)
    model = _model(fabric)
    optimizer = adamw(model.parameters(), lr=LR)
    x, y = _batches()[0]
    rows = slice(4 * fabric.strategy.device_mesh["data_parallel"].get_local_rank(), None)
    fabric.backward(_loss(model(x[rows][:4]), y[rows][:4]))
    optimizer.step()
    saved = {n: _full(p) for n, p in model.module.named_parameters()}
    fabric.save(f"{folder}/distributed", {"model": model})
    plain = _fabric(LLAMA_PLAN, data_parallel_size=4, tensor_parallel_size=1, save_distributed_checkpoint=False)
    model = _model(plain)
    plain.load(f"{folder}/distributed", {"model": model})
    out = {"into_plain": max((_full(p) - saved[n]).abs().max().item() for n, p in model.module.named_parameters())}
    plain.save(f"{folder}/full.pt", {"model": model})
    back = _fabric(LLAMA_PLAN.replace(float8=ROWWISE), data_parallel_size=2, tensor_parallel_size=2)
    model = _model(back)
    back.load(f"{folder}/full.pt", {"model": model})
    out["back_into_float8"] = max((_full(p) - saved[n]).abs().max().item() for n, p in model.module.named_parameters())
    return out


def _hugging_face(pretrained: str, out: str) -> dict[str, float]:
    """A Hugging Face Llama in float8 at 2x2 from ``load_pretrained``, a step, then ``save_pretrained``: plain weights."""
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_config
    from modelpar.hf import load_pretrained, plan_for, save_pretrained

    config = tiny_config(hidden_size=64, intermediate_size=128)
    with torch.device("meta"):
        plan = plan_for(AutoModelForCausalLM.from_config(config)).replace(float8=ROWWISE)
    fabric = _fabric(plan, data_parallel_size=2, tensor_parallel_size=2)
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(config)
    model = fabric.setup_module(model)
    load_pretrained(model, pretrained)
    result = {"float8_layers": float(sum(type(m).__name__ == "Float8Linear" for m in model.module.modules()))}
    optimizer = adamw(model.parameters(), lr=LR)
    x, y = _batches()[0]
    rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    fabric.backward(_loss(model(x[4 * rank : 4 * rank + 4]).logits, y[4 * rank : 4 * rank + 4]))
    optimizer.step()
    trained = {n: _full(p) for n, p in model.module.named_parameters()}
    save_pretrained(model, out)
    if fabric.global_rank == 0:
        saved = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
        result["saved"] = max((saved[n].detach() - p).abs().max().item() for n, p in trained.items())
        before = AutoModelForCausalLM.from_pretrained(pretrained).named_parameters()
        result["moved"] = max((saved[n].detach() - p.detach()).abs().max().item() for n, p in before)
    return result


def _trainer(folder: str) -> dict[str, Any]:
    """The Trainer, no plan (its own FSDP2 plan with `float8`): the model is the LightningModule, whose forward
    ``training_step`` never calls, so the refresh must come from the blocks' hooks."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            with torch.device("meta"):
                self.model = Llama(CFG)
            self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            self.seen.append((batch[0].clone(), batch[1].clone()))
            return _loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    x, y = torch.cat([b[0] for b in _batches()]), torch.cat([b[1] for b in _batches()])
    module = Module()
    strategy = TrainerStrategy(float8=TENSORWISE, data_parallel_size=4, tensor_parallel_size=1, timeout=PG_TIMEOUT)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=STEPS,
        default_root_dir=folder,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH // 4))
    module.unshard()  # the root's own parameters: the Trainer never calls its forward, which would gather them
    with torch.no_grad():
        module.model(x[:2])  # the forward after the last update
    module.reshard()
    refresh = getattr(module, "_modelpar_float8_scales", None)
    return {
        "steps": len(module.seen),
        "refreshes": refresh.refreshes if refresh is not None else None,
        "scales_current": _scales_are_current(module),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
    }


def run_grid(folder: str, pretrained: str) -> dict[str, Any]:
    return {
        "tensorwise_2x2_sequence_parallel_accumulated": _train(
            TENSORWISE,
            plan=LLAMA_PLAN.replace(sequence_parallel=True),
            chunks=2,
            data_parallel_size=2,
            tensor_parallel_size=2,
        ),
        "rowwise_2x2": _train(ROWWISE, data_parallel_size=2, tensor_parallel_size=2),
        "tensorwise_hsdp_selective": _train(
            TENSORWISE,
            plan=LLAMA_PLAN.replace(activation_checkpointing="selective"),
            data_parallel_size=4,
            data_parallel_replicate_size=2,
            tensor_parallel_size=1,
        ),
        "tensorwise_pp2_dp2": _train(
            TENSORWISE,
            pipeline=True,
            chunks=2,
            pipeline_parallel_size=2,
            pipeline_microbatches=2,
            data_parallel_size=2,
            tensor_parallel_size=1,
        ),
        "tensorwise_no_code": _train(TENSORWISE, plan=None, data_parallel_size=4, tensor_parallel_size=1),
        "tensorwise_compiled_dp4": _compiled(),
        "rowwise_cp2_dp2": _train(
            ROWWISE, context=True, data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=1
        ),
        "rowwise_ep2_dp4": _train(
            ROWWISE,
            plan=LLAMA_MOE_PLAN,
            cfg=MOE_CFG,
            data_parallel_size=4,
            expert_parallel_size=2,
            tensor_parallel_size=1,
        ),
        "checkpoints": _checkpoints(folder),
        "trainer": _trainer(folder + "-trainer"),
        "hugging_face": _hugging_face(pretrained, folder + "-hf"),
    }


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_config

    pretrained = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(hidden_size=64, intermediate_size=128)).save_pretrained(pretrained)
    folder = str(tmp_path_factory.mktemp("float8") / "ckpt")
    return run_distributed(run_grid, 4, folder, str(pretrained)), folder


TRAINED = [
    "tensorwise_2x2_sequence_parallel_accumulated",
    "rowwise_2x2",
    "tensorwise_hsdp_selective",
    "tensorwise_pp2_dp2",
    "tensorwise_no_code",
    "tensorwise_compiled_dp4",
    "rowwise_cp2_dp2",
    "rowwise_ep2_dp4",
]


@pytest.mark.parametrize("case", TRAINED)
def test_float8_trains_like_one_float8_process_on_every_layout(
    grid: tuple[list[dict[str, Any]], str], case: str
) -> None:
    later = TENSORWISE_TP_TOL if case.startswith("tensorwise_2x2") else LOSS_TOL
    for rank, results in enumerate(grid[0]):
        result = results[case]
        assert result["init"] == 0.0, (rank, result)  # the float8 model starts from one process's weights
        assert all(error < LOSS_TOL for error in result["first"].values()), (rank, result)
        assert result["loss"] < later and result["grad"] < later and result["norm"] < later, (rank, result)
        assert result["param"] < max(later, PARAM_TOL), (rank, result)
        assert result["float8_layers"] > 0 and result["state_types"] == ["Tensor"], (rank, result)


@pytest.mark.parametrize("case", [c for c in TRAINED if c.startswith("tensorwise")])
def test_the_float8_all_gathers_scales_are_refreshed_once_per_weight_update(
    grid: tuple[list[dict[str, Any]], str], case: str
) -> None:
    for results in grid[0]:
        result = results[case]
        # One refresh before the first forward, then one per optimizer step that a forward followed: not one per
        # forward (accumulation, micro-batches), and none missed (the scales are the current weights').
        assert result["refreshes"] and set(result["refreshes"]) == {STEPS + 1}, result
        assert result["scales_current"] is True, result


def test_the_trainer_keeps_the_scales_current_though_it_never_calls_the_root_forward(
    grid: tuple[list[dict[str, Any]], str],
) -> None:
    for results in grid[0]:
        result = results["trainer"]
        assert result == {"steps": STEPS, "refreshes": STEPS + 1, "scales_current": True, "float8_layers": 14}, result


def test_rowwise_gathers_in_high_precision_and_needs_no_scale_refresh(grid: tuple[list[dict[str, Any]], str]) -> None:
    assert all(results["rowwise_2x2"]["refreshes"] == [] for results in grid[0])


def test_a_float8_checkpoint_loads_exactly_without_float8_on_another_layout_and_back(
    grid: tuple[list[dict[str, Any]], str],
) -> None:
    for results in grid[0]:
        assert results["checkpoints"] == {"into_plain": 0.0, "back_into_float8": 0.0}, results["checkpoints"]


def test_float8_checkpoints_read_without_torchao(grid: tuple[list[dict[str, Any]], str], tmp_path: Any) -> None:
    folder = grid[1]
    code = (
        "import sys, torch; sys.modules['torchao'] = None\n"  # any import of torchao fails
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"dcp_to_torch_save({folder + '/distributed'!r}, {str(tmp_path / 'converted.pt')!r})\n"
        f"converted = torch.load({str(tmp_path / 'converted.pt')!r}, weights_only=True)\n"
        f"full = torch.load({folder + '/full.pt'!r}, weights_only=True)\n"
        "print(sorted({type(v).__name__ for v in converted['model'].values()}), len(full['model']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["['Tensor']", str(len(dict(Llama(CFG).named_parameters())))]


def test_a_hugging_face_model_in_float8_loads_trains_and_saves_ordinary_weights(
    grid: tuple[list[dict[str, Any]], str],
) -> None:
    result = grid[0][0]["hugging_face"]
    assert result["float8_layers"] == 14  # 7 projections per layer; the LM head stays high precision
    assert result["saved"] == 0.0 and result["moved"] > 0, result
