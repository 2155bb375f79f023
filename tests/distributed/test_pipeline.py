"""Pipeline parallelism against one process: every offered schedule, with FSDP, TP and HSDP, checkpoints across pp.

One spawn of 2 processes and one of 4. Each case builds the model on the meta device from a seed (each rank
materializes only its stages) and a one-process reference eagerly from the same seed, then compares: the initial
weights (bit for bit), the loss ``pipeline_step`` returns (the exact token mean, with padded targets so that the
micro-batches and the data-parallel ranks count different numbers of tokens), the clipped gradient norm (one norm
over every stage) and the weights after AdamW steps. Checkpoints written at one pipeline size load at others.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.distributed.tensor import DTensor

from harness import PG_TIMEOUT, run_distributed
from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN
from parity import adamw, error_text, shard_difference

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)
#: Every block a MoE, experts split over 2 ranks; the routers' auxiliary losses off: a pipeline's loss is the last
#: stage's output loss (docs/pipeline.md).
MOE_CFG = LlamaConfig(
    vocab_size=64,
    dim=32,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    ffn_hidden=64,
    max_seq_len=16,
    n_experts=4,
    aux_loss_coef=0.0,
    z_loss_coef=0.0,
)
DEEP_CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)
BATCH, SEQ, STEPS, LR = 8, 12, 3, 1e-2
#: Losses and norms agree to float32 rounding; weights after AdamW (which divides by the root of small second
#: moments) to a little more.
LOSS_TOL, PARAM_TOL = 1e-5, 5e-4


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), ignore_index=-100)


def _batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, with targets padded unevenly (some micro-batches and ranks count fewer tokens)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CFG.vocab_size, (BATCH * dp, SEQ), generator=g)
        y = torch.randint(0, CFG.vocab_size, (BATCH * dp, SEQ), generator=g)
        y[0, :7] = -100
        y[3, 2:] = -100
        out.append((x, y))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _fabric(world: int, parallelize_fn: Any = LLAMA_PLAN, **kwargs: Any) -> Fabric:
    strategy = ModelParallelStrategy(parallelize_fn, timeout=PG_TIMEOUT, **kwargs)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _pipelined(fabric: Fabric, cfg: LlamaConfig = CFG) -> Any:
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(cfg)
    return fabric.setup_module(model)


def _worst(model: Any, ref: torch.nn.Module) -> float:
    """Largest difference between this rank's parameters (its shards of its stages) and the same part of the
    reference's (names are the unsplit model's)."""
    ref_params = dict(ref.named_parameters())
    return max(shard_difference(p, ref_params[n]) for n, p in model.module.named_parameters())


def _train(world: int, *, accumulate: bool = False, cfg: LlamaConfig = CFG, **kwargs: Any) -> dict[str, Any]:
    """Steps of the pipelined model and the reference on the same global batches; the worst differences.

    Under context parallelism each rank takes its sequence shard (``shard_batch``) and passes its positions to
    every stage."""
    from modelpar.context import shard_batch

    fabric = _fabric(world, **kwargs)
    mesh = fabric.strategy.device_mesh
    dp_mesh = mesh["data_parallel"]
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    model = _pipelined(fabric, cfg)
    torch.manual_seed(0)
    ref = Llama(cfg)
    init = _worst(model, ref)
    optimizer = adamw(model.parameters(), lr=LR, weight_decay=0.1)
    ref_opt = adamw(ref.parameters(), lr=LR, weight_decay=0.1)
    loss_err = norm_err = 0.0
    for x, y in _batches(dp):
        xs, ys = x[BATCH * dp_rank : BATCH * (dp_rank + 1)], y[BATCH * dp_rank : BATCH * (dp_rank + 1)]
        if accumulate:  # two calls on the halves, each weighted 1/2: the gradients of the mean of the two means
            half = BATCH // 2
            losses = [
                fabric.strategy.pipeline_step(model, xs[s : s + half], ys[s : s + half], _loss, grad_scale=0.5)
                for s in (0, half)
            ]
            loss = sum(losses) / 2
            ref_loss = (
                sum(
                    _loss(ref(x[BATCH * r + s : BATCH * r + s + half]), y[BATCH * r + s : BATCH * r + s + half])
                    for s in (0, half)
                    for r in range(dp)
                )
                / (2 * dp)
                if dp > 1
                else (_loss(ref(x[:half]), y[:half]) + _loss(ref(x[half:]), y[half:])) / 2
            )
        else:
            batch = shard_batch({"input_ids": xs, "labels": ys}, mesh)  # cp = 1: positions only
            loss = fabric.strategy.pipeline_step(
                model, batch["input_ids"], batch["labels"], _loss, positions=batch["position_ids"]
            )
            ref_loss = _loss(ref(x), y)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        loss_err = max(loss_err, abs(float(loss) - float(ref_loss)))
        norm_err = max(norm_err, abs(float(norm) - float(ref_norm)))
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    x, y = _batches(dp)[0]
    size = BATCH // 2 if accumulate else BATCH  # the shape of the training steps: the pipeline's buffers are sized
    x, y = (
        torch.cat([x[BATCH * r : BATCH * r + size] for r in range(dp)]),
        torch.cat([y[BATCH * r : BATCH * r + size] for r in range(dp)]),
    )
    rows = slice(size * dp_rank, size * (dp_rank + 1))
    batch = shard_batch({"input_ids": x[rows], "labels": y[rows]}, mesh)
    evaluated = fabric.strategy.pipeline_eval(
        model, batch["input_ids"], batch["labels"], _loss, positions=batch["position_ids"]
    )
    with torch.no_grad():
        eval_err = abs(float(evaluated) - float(_loss(ref(x), y)))
    return {
        "init": init,
        "loss": max(loss_err, eval_err),
        "norm": norm_err,
        "param": _worst(model, ref),
        "mesh": tuple(mesh.shape),
        "names": sorted(n for n, _ in model.module.named_parameters()),
    }


def _checkpoint_across_sizes(world: int, folder: str, save: dict[str, Any], loads: list[dict[str, Any]]) -> list[float]:
    """Train a step at one layout, save a distributed checkpoint, load it at each other layout: the difference."""
    fabric = _fabric(world, **save)
    model = _pipelined(fabric)
    optimizer = adamw(model.parameters(), lr=LR)
    x, y = _batches(1)[0]
    fabric.strategy.pipeline_step(model, x, y, _loss)
    optimizer.step()
    fabric.save(folder, {"model": model})
    saved = {n: _full(p).clone() for n, p in model.module.named_parameters()}
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, saved)
    every = {n: t for part in gathered for n, t in part.items()}
    worst = []
    full_file = folder + ".pt"  # the full format: rank 0 writes every stage's tensors, under the unsplit names
    fabric.strategy._core.save_distributed_checkpoint = False  # as tests/distributed/test_checkpoint.py switches
    fabric.save(full_file, {"model": model, "optimizer": optimizer})
    fabric.strategy._core.save_distributed_checkpoint = True
    if fabric.global_rank == 0:
        written = torch.load(full_file, weights_only=True)
        worst.append(max((written["model"][n] - t).abs().max().item() for n, t in every.items()))
        assert set(written["model"]) == set(every) and len(written["optimizer"]["state"]) == len(every)
    raw = {n: t.clone() for n, t in Llama(CFG).state_dict().items()}
    reference = Llama(CFG)
    fabric.load_raw(folder, reference)  # a plain module from the distributed folder: every stage's tensors
    worst.append(max((reference.state_dict()[n] - every[n]).abs().max().item() for n in every))
    del raw
    for layout in loads:
        other = _fabric(world, **layout)
        if layout.get("pipeline_parallel_size", 1) > 1:
            loaded = _pipelined(other)
        else:
            torch.manual_seed(1)
            with other.init_module(empty_init=True):
                loaded = other.setup_module(Llama(CFG))
        other_opt = adamw(loaded.parameters(), lr=LR)
        for source in (folder, full_file):  # the distributed folder, then the full file: both load exactly
            other.load(source, {"model": loaded, "optimizer": other_opt} if source == full_file else {"model": loaded})
            module = getattr(loaded, "module", loaded)
            worst.append(max((_full(p) - every[n]).abs().max().item() for n, p in module.named_parameters()))
    return worst


def _transfers(schedule: str) -> dict[str, int]:
    """Point-to-point sends and receives of one step (the second: the first also infers shapes), counted by torch's
    profiler from the ops gloo runs (``CommDebugMode``'s module tracker fails on pipeline stages in torch 2.13)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fabric = _fabric(
        2, pipeline_parallel_size=2, data_parallel_size=1, pipeline_schedule=schedule, pipeline_microbatches=4
    )
    model = _pipelined(fabric)
    x, y = _batches(1)[0]
    fabric.strategy.pipeline_step(model, x, y, _loss)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fabric.strategy.pipeline_step(model, x, y, _loss)
    counted = Counter(event.name for event in prof.events())
    return {"send": counted["c10d::send"], "recv": counted["c10d::recv_"], "all_reduce": counted["gloo:all_reduce"]}


def _refusals() -> dict[str, str]:
    fabric = _fabric(2, pipeline_parallel_size=2, data_parallel_size=1, pipeline_microbatches=4)
    model = _pipelined(fabric)
    x = torch.zeros(6, SEQ, dtype=torch.long)
    out = {"batch": error_text(lambda: fabric.strategy.pipeline_step(model, x, x, _loss))}
    out["direct call"] = error_text(lambda: model(x))
    tokens = torch.zeros(8, SEQ, dtype=torch.long)
    fabric.strategy.pipeline_step(model, tokens, tokens, _loss)
    smaller = torch.zeros(4, SEQ, dtype=torch.long)  # a last batch without drop_last
    out["shape"] = error_text(lambda: fabric.strategy.pipeline_step(model, smaller, smaller, _loss))
    out["no pipeline"] = error_text(lambda: fabric.strategy.pipeline_step(torch.nn.Linear(2, 2), x, x, _loss))
    y = torch.full((8, SEQ), -100)
    out["no tokens"] = error_text(lambda: fabric.strategy.pipeline_step(model, torch.zeros(8, SEQ).long(), y, _loss))
    too_many = _fabric(
        2,
        pipeline_parallel_size=2,
        data_parallel_size=1,
        pipeline_schedule="Interleaved1F1B",
        pipeline_stages_per_rank=3,
        pipeline_microbatches=6,
    )
    out["stages"] = error_text(lambda: _pipelined(too_many))
    return out


def _trainer_run(folder: str) -> dict[str, Any]:
    """The Trainer: a LightningModule with manual optimization whose ``training_step`` calls ``pipeline_step``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            with torch.device("meta"):
                self.model = Llama(CFG)
            self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.losses: list[float] = []
            self.norms: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, index: int) -> None:
            x, y = batch
            self.seen.append((x.clone(), y.clone()))
            optimizer = self.optimizers()
            loss = self.trainer.strategy.pipeline_step(self, x, y, _loss)
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.losses.append(float(loss))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self.parameters(), lr=LR, weight_decay=0.1)

    (x, y), _, _ = _batches(1)
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH // 2)  # 2 steps of 4 samples, 2 micro-batches each
    module = Module()
    strategy = TrainerStrategy(
        pipeline_parallel_size=2, data_parallel_size=1, pipeline_microbatches=2, timeout=PG_TIMEOUT
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    trainer.fit(module, data)
    torch.manual_seed(0)
    ref = Llama(CFG)
    ref_opt = adamw(ref.parameters(), lr=LR, weight_decay=0.1)
    loss_err = 0.0
    for (bx, by), loss in zip(module.seen, module.losses, strict=True):  # the batches the Trainer's sampler chose
        ref_loss = _loss(ref(bx), by)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(loss - float(ref_loss)))
    ref_params = dict(ref.named_parameters())
    param = max(
        (_full(p) - ref_params[n.removeprefix("model.")].detach()).abs().max().item()
        for n, p in module.named_parameters()
    )
    return {"steps": len(module.losses), "loss": loss_err, "param": param}


def run_two(folder: str) -> dict[str, Any]:
    two = {"pipeline_parallel_size": 2, "data_parallel_size": 1, "tensor_parallel_size": 1}
    results: dict[str, Any] = {}
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"):
        results[schedule] = _train(2, pipeline_schedule=schedule, pipeline_microbatches=4, **two)
    results["accumulate"] = _train(2, accumulate=True, pipeline_microbatches=2, **two)
    # A hand-written cut (1 block, then 3) and activation checkpointing applied per stage by the plan.
    results["split_by_hand"] = _train(
        2,
        parallelize_fn=LLAMA_PLAN.replace(activation_checkpointing="full"),
        pipeline_split=[["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]],
        pipeline_microbatches=4,
        **two,
    )
    results["checkpoint"] = _checkpoint_across_sizes(
        2, folder, two, [{"data_parallel_size": 2, "tensor_parallel_size": 1}, {**two, "pipeline_schedule": "GPipe"}]
    )
    results["transfers"] = {schedule: _transfers(schedule) for schedule in ("1F1B", "Interleaved1F1B")}
    results["refusals"] = _refusals()
    results["trainer"] = _trainer_run(folder + "-trainer")
    return results


def _hugging_face(world: int, pretrained: str, out: str) -> dict[str, float]:
    """A Hugging Face Llama at pp=2 x dp=2 from ``load_pretrained``, trained, then saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_config
    from modelpar.hf import load_pretrained, save_pretrained

    strategy = ModelParallelStrategy(pipeline_parallel_size=2, data_parallel_size=world // 2, timeout=PG_TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fabric.setup_module(model)  # the root's init_weights() reaches every stage: not drawn for the others
    warned = any("random draws were skipped" in str(w.message) for w in caught)
    load_pretrained(model, pretrained)  # each rank reads only its stage's blocks
    ref = AutoModelForCausalLM.from_pretrained(pretrained)
    ref_params = dict(ref.named_parameters())
    worst = {"load": max((_full(p) - ref_params[n]).abs().max().item() for n, p in model.module.named_parameters())}
    optimizer = adamw(model.parameters(), lr=LR)
    ref_opt = adamw(ref.parameters(), lr=LR)
    dp = strategy.device_mesh["data_parallel"]
    worst["loss"] = 0.0
    for x, y in _batches(dp.size())[:2]:
        rows = slice(BATCH * dp.get_local_rank(), BATCH * (dp.get_local_rank() + 1))
        loss = strategy.pipeline_step(model, x[rows], y[rows], _loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = _loss(ref(x).logits, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst["loss"] = max(worst["loss"], abs(float(loss) - float(ref_loss)))
    worst["param"] = max((_full(p) - ref_params[n]).abs().max().item() for n, p in model.module.named_parameters())
    worst["warned"] = float(warned)
    save_pretrained(model, out)  # every stage's tensors, in the family's own format
    if fabric.global_rank == 0:
        saved = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
        worst["saved"] = max((saved[n] - p).abs().max().item() for n, p in ref_params.items())
    return worst


def run_four(folder: str, pretrained: str) -> dict[str, Any]:
    pp2 = {"pipeline_parallel_size": 2, "pipeline_microbatches": 4}
    results = {
        "pp2_dp2": _train(4, data_parallel_size=2, tensor_parallel_size=1, **pp2),
        "pp2_tp2": _train(4, data_parallel_size=1, tensor_parallel_size=2, **pp2),
        "pp2_tp2_sequence_loss_parallel": _train(
            4,
            parallelize_fn=LLAMA_PLAN.replace(sequence_parallel=True, loss_parallel=True),  # vocab-sharded logits
            data_parallel_size=1,
            tensor_parallel_size=2,
            **pp2,
        ),
        "pp2_hsdp": _train(4, data_parallel_size=2, data_parallel_replicate_size=2, tensor_parallel_size=1, **pp2),
        "pp4": _train(4, pipeline_parallel_size=4, data_parallel_size=1, tensor_parallel_size=1),
        **{
            f"pp4_{schedule}": _train(
                4,
                cfg=DEEP_CFG,  # 8 blocks: the looped schedules' 8 stages (2 per rank)
                pipeline_parallel_size=4,
                data_parallel_size=1,
                tensor_parallel_size=1,
                pipeline_schedule=schedule,
                pipeline_microbatches=8,
            )
            for schedule in ("GPipe", "Interleaved1F1B", "LoopedBFS")
        },
        "pp2_cp2": _train(4, data_parallel_size=1, context_parallel_size=2, tensor_parallel_size=1, **pp2),
        "pp2_ep2": _train(
            4,
            cfg=MOE_CFG,
            parallelize_fn=LLAMA_MOE_PLAN,
            data_parallel_size=2,
            expert_parallel_size=2,
            tensor_parallel_size=1,
            **pp2,
        ),
    }
    results["checkpoint"] = _checkpoint_across_sizes(
        4,
        folder,
        {"data_parallel_size": 2, "tensor_parallel_size": 1, **pp2},
        [
            {"data_parallel_size": 4, "tensor_parallel_size": 1},
            {"pipeline_parallel_size": 4, "data_parallel_size": 1, "tensor_parallel_size": 1},
            {"data_parallel_size": 1, "tensor_parallel_size": 2, **pp2},
        ],
    )
    results["hugging_face"] = _hugging_face(4, pretrained, folder + "-hf")
    return results


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_two, 2, str(tmp_path_factory.mktemp("pp2") / "ckpt"))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_config

    pretrained = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=4)).save_pretrained(pretrained)
    return run_distributed(run_four, 4, str(tmp_path_factory.mktemp("pp4") / "ckpt"), str(pretrained))


def _check(result: dict[str, Any]) -> None:
    assert result["init"] == 0.0, result  # each rank's stages hold one process's initial values, bit for bit
    assert result["loss"] < LOSS_TOL and result["norm"] < LOSS_TOL and result["param"] < PARAM_TOL, result


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"])
def test_each_schedule_at_pp2_trains_as_one_process(two: list[dict[str, Any]], schedule: str) -> None:
    for rank in two:
        _check(rank[schedule])
    assert two[0][schedule]["mesh"] == (2, 1, 1)


def test_each_rank_holds_only_its_stages_under_the_unsplit_names(two: list[dict[str, Any]]) -> None:
    first, last = two[0]["1F1B"]["names"], two[1]["1F1B"]["names"]
    assert "tok_embeddings.weight" in first and "output.weight" in last
    assert not set(first) & set(last)
    looped = [r["Interleaved1F1B"]["names"] for r in two]  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert "layers.0.attention.wq.weight" in looped[0] and "layers.2.attention.wq.weight" in looped[0]
    assert "layers.1.attention.wq.weight" in looped[1] and "layers.3.attention.wq.weight" in looped[1]


def test_each_micro_batch_crosses_each_stage_boundary_once_each_way(two: list[dict[str, Any]]) -> None:
    for rank in two:
        # 2 stages, 4 micro-batches: 4 activations one way, 4 gradients back; one all-reduce for the loss.
        assert rank["transfers"]["1F1B"] == {"send": 4, "recv": 4, "all_reduce": 1}
        # 4 stages on 2 ranks (0, 2 | 1, 3): 3 boundaries x 4 micro-batches x 2 directions = 24 transfers, 12 each way
        assert rank["transfers"]["Interleaved1F1B"] == {"send": 12, "recv": 12, "all_reduce": 1}


def test_a_hand_written_split_with_activation_checkpointing_trains_as_one_process(two: list[dict[str, Any]]) -> None:
    for rank in two:
        _check(rank["split_by_hand"])
    assert "layers.0.attention.wq.weight" in two[0]["split_by_hand"]["names"]
    assert "layers.1.attention.wq.weight" in two[1]["split_by_hand"]["names"]


def test_accumulation_over_two_calls_scales_gradients_once(two: list[dict[str, Any]]) -> None:
    for rank in two:
        _check(rank["accumulate"])


def test_checkpoints_from_pp2_in_both_formats_load_exactly_at_pp1_and_again_at_pp2(two: list[dict[str, Any]]) -> None:
    for rank in two:
        assert set(rank["checkpoint"]) == {0.0} and len(rank["checkpoint"]) == (6 if rank is two[0] else 5)


def test_bad_pipeline_input_is_refused_on_every_rank(two: list[dict[str, Any]]) -> None:
    same = [{k: v for k, v in rank["refusals"].items() if k != "direct call"} for rank in two]  # it names the stage
    assert same[0] == same[1]
    refusals = two[0]["refusals"]
    assert (
        "ValueError" in refusals["batch"] and "6 samples" in refusals["batch"] and "multiple of 4" in refusals["batch"]
    )
    assert "ValueError" in refusals["no tokens"] and "ignore_index=-100" in refusals["no tokens"]
    assert "PipelineSplitError" in refusals["stages"] and "only 4 blocks" in refusals["stages"]
    assert (
        "ValueError" in refusals["shape"] and "inputs (4, 12)" in refusals["shape"] and "(8, 12)" in refusals["shape"]
    )
    assert "RuntimeError" in refusals["direct call"] and "strategy.pipeline_step(" in refusals["direct call"]
    assert "ValueError" in refusals["no pipeline"] and "pipeline_parallel_size > 1" in refusals["no pipeline"]


def test_trainer_with_manual_optimization_trains_through_pipeline_step_as_one_process(
    two: list[dict[str, Any]],
) -> None:
    for rank in two:
        assert rank["trainer"]["steps"] == 2
        assert rank["trainer"]["loss"] < LOSS_TOL and rank["trainer"]["param"] < PARAM_TOL, rank["trainer"]


@pytest.mark.parametrize(
    "case",
    [
        "pp2_dp2",
        "pp2_tp2",
        "pp2_tp2_sequence_loss_parallel",
        "pp2_hsdp",
        "pp4",
        "pp4_GPipe",
        "pp4_Interleaved1F1B",
        "pp4_LoopedBFS",
        "pp2_cp2",
        "pp2_ep2",
    ],
)
def test_pipeline_composes_with_fsdp_tp_hsdp_context_and_expert_parallelism(
    four: list[dict[str, Any]], case: str
) -> None:
    for rank in four:
        _check(rank[case])


def test_checkpoints_from_pp2_dp2_in_both_formats_load_exactly_at_dp4_pp4_and_pp2_tp2(
    four: list[dict[str, Any]],
) -> None:
    for rank in four:
        assert set(rank["checkpoint"]) == {0.0} and len(rank["checkpoint"]) == (8 if rank is four[0] else 7)


def test_hugging_face_llama_loads_trains_and_saves_at_pp2_dp2(four: list[dict[str, Any]]) -> None:
    for rank in four:
        hf = rank["hugging_face"]
        assert hf["load"] == 0.0 and hf["loss"] < LOSS_TOL and hf["param"] < PARAM_TOL, hf
    # the trained weights, as saved: rank 0 reads every stage's file back, and each rank measured only its own stage
    assert four[0]["hugging_face"]["saved"] == max(rank["hugging_face"]["param"] for rank in four)
    assert four[0]["hugging_face"]["warned"] == 1.0  # rank 0 said that init_weights() was not drawn for other stages
