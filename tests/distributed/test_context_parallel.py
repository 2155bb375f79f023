"""Context parallelism through the strategies, against one process: Llama plan, Hugging Face families, checkpoints.

One spawn of 4 CPU processes runs the grid. Each training case builds the single-process model from the same
seed, feeds it the whole global batch, and checks that the sharded run (each rank: its data-parallel slice of
the batch, then its load-balanced sequence shard from ``shard_batch``) gives the same global token-mean loss,
the same gradients and, after AdamW steps, the same weights: at cp=2 (dp=2), cp=4, cp=2 x tp=2 with sequence
and loss parallelism, cp=2 under HSDP, with full activation checkpointing, with right-padded batches whose
token counts differ per rank, for the Llama plan and for Hugging Face Llama and Qwen3 (a left-padded batch
through the attention mask). Checkpoints saved at cp=2 load at cp=1 and back, exactly; the bytes autograd
saves per rank fall as 1/cp; bad input is refused on every rank before any collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from modelpar.context import cross_entropy, shard_batch
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN, ParallelPlan, loss_parallel
from parity import (
    adamw,
    assert_matches,
    error_text,
    fsdp_blocks_only,
    full_state,
    lightning_style_fsdp,
    local_slice,
    make_fabric,
)

pytest.importorskip("transformers")

STEPS = 2
SEQ = 16  # divisible by 2 x cp for cp = 2 and 4
BATCH = 4
IGNORE = -100
CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)


def batches(steps: int, *, padded: bool = False, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable token sequences and next-token labels; ``padded``: rows end early, labels ignored there."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
        step = torch.randint(1, 5, (BATCH, 1), generator=g)
        seq = (start + step * torch.arange(SEQ + 1)) % CFG.vocab_size
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        if padded:  # right padding: lengths 16, 11, 5, 13, so each rank holds a different number of tokens
            for row, length in enumerate((SEQ, 11, 5, 13)):
                x[row, length:] = 0
                y[row, length - 1 :] = IGNORE
        out.append((x, y))
    return out


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


def case_llama_trains_like_one_process(
    dp: int, tp: int, cp: int, plan: ParallelPlan = LLAMA_PLAN, *, padded: bool = False, **kw: Any
) -> dict[str, Any]:
    """Global token-mean loss, gradients, clipping and weights after AdamW steps equal one process."""
    fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=plan, context_parallel_size=cp, **kw)
    mesh = fabric.strategy.device_mesh
    torch.manual_seed(0)
    ref = Llama(CFG)
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=1e-2, weight_decay=0.1)
    kernel = model.module.layers[0].attention.attention_kernel
    out: dict[str, Any] = {"kernel": type(kernel).__name__, "axes": mesh.mesh_dim_names, "losses": []}
    for step, (x, y) in enumerate(batches(STEPS, padded=padded)):
        batch = shard_batch({"input_ids": local_slice(fabric, x), "labels": local_slice(fabric, y)}, mesh)
        out["local_seq"] = batch["input_ids"].shape[1]
        logits = model(batch["input_ids"], batch["position_ids"])
        with loss_parallel(logits):
            loss = cross_entropy(logits, batch["labels"], mesh)
            fabric.backward(loss)
        ref_loss = reference_loss(ref(x), y)
        ref_loss.backward()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        global_loss = fabric.all_reduce(local.detach().clone())  # mean over every rank = the global token mean
        torch.testing.assert_close(global_loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        if step == STEPS - 1:
            got = fabric.clip_gradients(model, optimizer, max_norm=0.05)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        out["worst_param_diff"] = assert_matches(model, ref, "param")
        out["losses"].append(global_loss.item())
    return out


# -- Hugging Face --------------------------------------------------------------------------------------------
def _hf_config(family: str) -> Any:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import Qwen3Config

    from hf_tiny import TINY_SIZES

    sizes = {**TINY_SIZES, "max_position_embeddings": SEQ}
    return HFLlamaConfig(**sizes) if family == "llama" else Qwen3Config(head_dim=8, **sizes)


def case_hf_trains_like_one_process(family: str, dp: int, tp: int, cp: int) -> dict[str, Any]:
    """plan_for(model) under context parallelism: a right-padded batch through the attention mask, like one process."""
    from transformers import AutoModelForCausalLM

    from modelpar.hf import plan_for

    config = _hf_config(family)
    with torch.device("meta"):
        plan = plan_for(AutoModelForCausalLM.from_config(config))
    fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=plan, context_parallel_size=cp)
    mesh = fabric.strategy.device_mesh
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config)
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-3, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=1e-3, weight_decay=0.1)
    out: dict[str, Any] = {"implementation": model.module.config._attn_implementation}
    for x, y in batches(STEPS, padded=True):
        mask = (y != IGNORE) | (torch.arange(SEQ) == 0)  # a real token where it is followed by one (or starts)
        x = x % config.vocab_size
        batch = shard_batch(
            {
                "input_ids": local_slice(fabric, x),
                "labels": local_slice(fabric, y),
                "attention_mask": local_slice(fabric, mask),
            },
            mesh,
        )
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]
        ).logits
        loss = cross_entropy(logits, batch["labels"], mesh)
        fabric.backward(loss)
        ref_loss = reference_loss(ref(input_ids=x, attention_mask=mask.long()).logits, y)
        ref_loss.backward()
        torch.testing.assert_close(fabric.all_reduce(loss.detach().clone()), ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        out["worst_param_diff"] = assert_matches(model, ref, "param")
    return out


# -- checkpoints across context-parallel sizes ---------------------------------------------------------------
def case_checkpoints_move_between_context_parallel_sizes(root: str) -> dict[str, Any]:
    """Saved at cp=2 (dp=2), loaded at cp=1 (dp=4), saved again, loaded at cp=2 x tp=2: every tensor equal, exactly."""
    diffs: dict[str, float] = {}
    snapshots = []
    for index, (dp, tp, cp) in enumerate([(2, 1, 2), (4, 1, 1), (1, 2, 2)]):
        fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=LLAMA_PLAN, context_parallel_size=cp)
        torch.manual_seed(index)  # a different init each time: only the checkpoint can make them equal
        model = fabric.setup_module(Llama(CFG))
        optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": optimizer}
        if index == 0:
            x, y = batches(1)[0]
            batch = shard_batch(
                {"input_ids": local_slice(fabric, x), "labels": local_slice(fabric, y)}, fabric.strategy.device_mesh
            )
            fabric.backward(
                cross_entropy(
                    model(batch["input_ids"], batch["position_ids"]), batch["labels"], fabric.strategy.device_mesh
                )
            )
            optimizer.step()
        else:
            fabric.load(f"{root}/ckpt{index - 1}", state)
            loaded = full_state(model, optimizer)
            diffs[f"cp{cp}"] = max((loaded[k] - snapshots[-1][k]).abs().max().item() for k in snapshots[-1])
        snapshots.append(full_state(model, optimizer))
        fabric.save(f"{root}/ckpt{index}", state)
    return diffs


# -- activation memory ---------------------------------------------------------------------------------------
def _saved_bytes(fn: Any) -> tuple[Any, int]:
    """``fn()``, and the bytes autograd saves for backward meanwhile: each storage once, weights left out."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        base = local._base if local._base is not None else local  # a weight's transpose is a view of the weight
        if not (base.is_leaf and base.requires_grad):  # FSDP's unsharded parameters are leaves; activations not
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def case_activation_bytes_per_rank_fall_as_one_over_cp() -> dict[int, int]:
    """One 64-token sample per context-parallel group; the bytes each rank saves for backward, at cp = 1, 2, 4."""
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
    tokens = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(3))
    measured: dict[int, int] = {}
    for cp in (1, 2, 4):
        fabric = make_fabric(4 // cp, 1, world_size=4, parallelize_fn=LLAMA_PLAN, context_parallel_size=cp)
        mesh = fabric.strategy.device_mesh
        torch.manual_seed(0)
        model = fabric.setup_module(Llama(cfg))
        batch = shard_batch({"input_ids": tokens, "labels": tokens}, mesh)

        def step(m: Any = model, b: dict[str, Any] = batch, me: Any = mesh) -> torch.Tensor:
            return cross_entropy(m(b["input_ids"], b["position_ids"]), b["labels"], me)

        loss, measured[cp] = _saved_bytes(step)
        fabric.backward(loss)
    return measured


# -- bad input -----------------------------------------------------------------------------------------------
def case_bad_input_is_refused_on_every_rank() -> dict[str, str]:

    errors: dict[str, str] = {}
    for name, fn in {
        "fsdp_on_dp_only": lightning_style_fsdp,
        "kernel_not_replaced": fsdp_blocks_only,
        "plan_without_attention": ParallelPlan(fsdp_units=("layers.*",)),
    }.items():
        fabric = make_fabric(2, 1, world_size=4, parallelize_fn=fn, context_parallel_size=2)
        errors[name] = error_text(lambda f=fabric: f.setup_module(Llama(CFG)))
    x, y = batches(1)[0]
    errors["seq_len"] = error_text(
        lambda: shard_batch({"input_ids": x[:, :14], "labels": y[:, :14]}, fabric.strategy.device_mesh)
    )
    t = torch.ones(())
    dist.all_reduce(t)  # no rank was left inside a collective
    errors["sum"] = str(t.item())
    return errors


def grid(root: str) -> dict[str, Any]:
    sp_lp = LLAMA_PLAN.replace(sequence_parallel=True, loss_parallel=True)
    return {
        "cp2": case_llama_trains_like_one_process(2, 1, 2),
        "cp4": case_llama_trains_like_one_process(1, 1, 4),
        "cp2_tp2_sp_lp": case_llama_trains_like_one_process(1, 2, 2, sp_lp),
        "cp2_hsdp": case_llama_trains_like_one_process(2, 1, 2, data_parallel_replicate_size=2),
        "cp2_ac_padded": case_llama_trains_like_one_process(
            2, 1, 2, LLAMA_PLAN.replace(activation_checkpointing="full"), padded=True
        ),
        "cp2_tp2_selective": case_llama_trains_like_one_process(
            1, 2, 2, LLAMA_PLAN.replace(activation_checkpointing="selective"), padded=True
        ),
        "hf_llama_cp2": case_hf_trains_like_one_process("llama", 2, 1, 2),
        "hf_qwen3_cp2_tp2": case_hf_trains_like_one_process("qwen3", 1, 2, 2),
        "checkpoints": case_checkpoints_move_between_context_parallel_sizes(root),
        "activation_bytes": case_activation_bytes_per_rank_fall_as_one_over_cp(),
        "errors": case_bad_input_is_refused_on_every_rank(),
    }


def kernel_and_strategy_grid(root: str) -> dict[str, Any]:
    """The whole context-parallel area in one spawn: the kernel's grid (raw meshes), then this module's."""
    from test_context_attention import grid as kernel_grid

    return {"kernel": kernel_grid(), "strategy": grid(root)}


@pytest.fixture(scope="module")
def results(context_parallel_spawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This module's part of the context-parallel spawn (``tests/distributed/conftest.py``)."""
    return [rank["strategy"] for rank in context_parallel_spawn]


LLAMA_CASES = ["cp2", "cp4", "cp2_tp2_sp_lp", "cp2_hsdp", "cp2_ac_padded", "cp2_tp2_selective"]


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_the_llama_plan_with_context_parallelism_trains_like_one_process(results, case):
    got = results[0][case]
    assert got["kernel"] == "ContextParallelAttention"
    assert "context_parallel" in got["axes"]
    assert len(got["losses"]) == STEPS and got["losses"][0] > got["losses"][-1]
    cp = {"cp4": 4}.get(case, 2)
    assert got["local_seq"] == SEQ // cp


@pytest.mark.parametrize("case", ["hf_llama_cp2", "hf_qwen3_cp2_tp2"])
def test_hugging_face_families_with_context_parallelism_train_like_one_process(results, case):
    assert results[0][case]["implementation"] == "modelpar_context_parallel"


def test_checkpoints_load_exactly_across_context_parallel_sizes(results):
    for result in results:
        assert result["checkpoints"] == {"cp1": 0.0, "cp2": 0.0}


def test_activation_bytes_per_rank_fall_as_one_over_the_context_parallel_size(results):
    measured = results[0]["activation_bytes"]
    for cp in (2, 4):
        ratio = measured[cp] / measured[1]
        # 1/cp of the per-token activations, plus the gathered keys and values of the whole sequence (GQA: small)
        assert 1 / cp <= ratio < 1 / cp + 0.1, (cp, measured)


def test_bad_input_is_refused_on_every_rank_with_the_fix(results):
    for result in results:
        errors = result["errors"]
        assert errors["fsdp_on_dp_only"].startswith("ValueError: Context parallelism was asked for"), errors
        assert "fsdp_kwargs(device_mesh)" in errors["fsdp_on_dp_only"]
        assert errors["kernel_not_replaced"].startswith("ValueError: "), errors
        assert "attention" in errors["kernel_not_replaced"]
        assert errors["plan_without_attention"].startswith("ValueError: Context parallelism needs every attention")
        assert errors["seq_len"].startswith("ValueError: "), errors
        assert "14" in errors["seq_len"]
        assert errors["sum"] == "4.0"
