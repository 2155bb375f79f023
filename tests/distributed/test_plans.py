"""``ParallelPlan`` options on real process groups, each against a single-process run of the same model and data.

One spawn of 4 processes runs the grid: the Llama plan at 2x2, sequence parallelism at 1x4, loss parallelism
at 2x2 (and with sequence parallelism), full and selective activation checkpointing, compile, HSDP 2x1x2 with
sequence parallelism, and the plan at tp=1. Each case trains a few AdamW steps and compares losses,
gradients and weights with one process; the test functions then read what each rank reported.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness import run_distributed
from modelpar.plans import LLAMA_PLAN, ParallelPlan, loss_parallel
from parity import assert_matches, global_batches, lm_loss, local_slice, make_fabric, setup_pair

STEPS = 3


def _count_forwards(model: nn.Module, names: list[str]) -> Counter[str]:
    calls: Counter[str] = Counter()
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda *_, n=name: calls.update([n]))
    return calls


def case_trains_like_one_process(
    plan: ParallelPlan, dp: int, tp: int, steps: int = STEPS, *, count_forwards: bool = True, **kw: Any
) -> dict[str, Any]:
    """Losses (computed inside ``loss_parallel``), gradients and weights after AdamW steps equal one process.

    ``count_forwards``: count the forwards of each block's first projection (for the checkpointing cases). Not in a
    compiled block: Dynamo guards on each hook's name and on the counter's size, so the blocks would compile four
    times instead of once (about 20 s of CPU per spawn on 2 cores).
    """
    fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=plan, **kw)
    model, optimizer, ref, ref_opt = setup_pair(fabric)
    inner = model.module
    # The first projection of each block: non-reentrant checkpointing stops recomputing once backward has what it
    # needs, so a block's last op may not run again.
    probes = ["layers.0.attention.wq", "layers.1.attention.wq"] if count_forwards else []
    calls = _count_forwards(inner, probes)
    out: dict[str, Any] = {"keys": sorted(inner.state_dict()), "names": sorted(n for n, _ in inner.named_parameters())}
    for x, y in global_batches(steps):
        logits = model(local_slice(fabric, x))
        out["logits"] = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else "plain"
        out["logits_view"] = not isinstance(logits, DTensor) and logits._base is not None
        with loss_parallel(logits):
            loss = lm_loss(logits, local_slice(fabric, y))
            fabric.backward(loss)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        torch.testing.assert_close(fabric.all_reduce(local.detach().clone()), ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        assert_matches(model, ref, "param")
    norm = inner.layers[0].attention_norm.weight
    out["norm_placements"] = [str(p) for p in norm.placements] if isinstance(norm, DTensor) else "plain"
    out["calls_per_step"] = {name: calls[name] / steps for name in probes}
    out["ref_keys"] = sorted(ref.state_dict())
    if plan.sequence_parallel:
        try:
            model(local_slice(fabric, x)[:, :-1])
        except ValueError as e:
            out["uneven_sequence"] = str(e)
    out["_model"] = inner
    return out


def case_compiled_blocks_train_like_one_process() -> dict[str, Any]:
    """``compile=True`` compiles each block, under FSDP alone (see docs/plans.md for compile with TP on CPU).

    The aot_eager backend (dynamo and AOTAutograd, no code generation) keeps it seconds; inductor takes a
    minute per process on a CPU.
    """
    original = nn.Module.compile

    def aot_eager(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, backend="aot_eager", **kwargs)

    with mock.patch.object(nn.Module, "compile", aot_eager):
        out = case_trains_like_one_process(
            LLAMA_PLAN.replace(compile=True, loss_parallel=True), 4, 1, steps=2, count_forwards=False
        )
    out["compiled"] = [name for name, m in out.pop("_model").named_modules() if m._compiled_call_impl is not None]
    return out


def grid() -> dict[str, Any]:
    plan = LLAMA_PLAN
    cases = {
        "default_2x2": lambda: case_trains_like_one_process(plan, 2, 2),
        "sequence_1x4": lambda: case_trains_like_one_process(plan.replace(sequence_parallel=True), 1, 4, steps=2),
        "loss_2x2": lambda: case_trains_like_one_process(plan.replace(loss_parallel=True), 2, 2),
        "ac_full_2x2": lambda: case_trains_like_one_process(
            plan.replace(activation_checkpointing="full"), 2, 2, steps=2
        ),
        "ac_selective_every_2": lambda: case_trains_like_one_process(
            plan.replace(activation_checkpointing="selective", ac_every=2, sequence_parallel=True), 2, 2, steps=2
        ),
        "compile_no_tp_4x1": case_compiled_blocks_train_like_one_process,
        "hsdp_sequence_loss_2x1x2": lambda: case_trains_like_one_process(
            plan.replace(sequence_parallel=True, loss_parallel=True), 2, 2, steps=2, data_parallel_replicate_size=2
        ),
    }
    results = {}
    for name, case in cases.items():
        start = time.perf_counter()
        results[name] = case()
        results[name].pop("_model", None)  # modules stay in the process
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(grid, 4, timeout=300)


def test_every_option_trains_like_one_process_and_keeps_the_names(results: list[dict[str, Any]]) -> None:
    print({case: out["seconds"] for case, out in results[0].items()})
    for r in results:
        for case, out in r.items():
            assert out["keys"] == out["ref_keys"], case  # no wrapper segment from checkpointing or compile
            assert out["names"] == sorted(k for k in out["ref_keys"] if "rope" not in k), case


def test_loss_parallel_keeps_the_logits_vocab_sharded_and_gathered_logits_are_not_views(
    results: list[dict[str, Any]],
) -> None:
    r = results[0]
    assert r["loss_2x2"]["logits"] == [str(Shard(2))]
    assert r["hsdp_sequence_loss_2x1x2"]["logits"] == [str(Shard(2))]
    for case in ("default_2x2", "sequence_1x4", "compile_no_tp_4x1"):
        assert r[case]["logits"] == "plain" and r[case]["logits_view"] is False, case


def test_sequence_parallel_norms_are_replicated_dtensors_on_the_tensor_parallel_axis(
    results: list[dict[str, Any]],
) -> None:
    r = results[0]
    assert r["default_2x2"]["norm_placements"] == [str(Shard(0))]  # FSDP only
    assert r["sequence_1x4"]["norm_placements"] == [str(Shard(0)), str(Replicate())]  # FSDP (1 rank) x SP
    assert r["hsdp_sequence_loss_2x1x2"]["norm_placements"] == [str(Replicate()), str(Shard(0)), str(Replicate())]


def test_activation_checkpointing_recomputes_the_chosen_blocks(results: list[dict[str, Any]]) -> None:
    r = results[0]
    assert set(r["default_2x2"]["calls_per_step"].values()) == {1.0}
    assert set(r["ac_full_2x2"]["calls_per_step"].values()) == {2.0}  # forward, then again in backward
    every_2 = r["ac_selective_every_2"]["calls_per_step"]
    assert every_2 == {"layers.0.attention.wq": 1.0, "layers.1.attention.wq": 2.0}  # the 2nd block only


def test_compile_compiles_each_block_and_trains_like_one_process(results: list[dict[str, Any]]) -> None:
    assert results[0]["compile_no_tp_4x1"]["compiled"] == ["layers.0", "layers.1"]


def test_sequence_parallel_refuses_a_sequence_that_does_not_split_evenly(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["sequence_1x4"]["uneven_sequence"] == (
            "Sequence parallelism splits the sequence across the 4 tensor-parallel ranks, but this batch has sequence"
            " length 11. Pad or cut sequences to a multiple of 4, or turn sequence parallelism off."
        )
