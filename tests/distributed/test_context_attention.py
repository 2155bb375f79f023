"""Context parallelism on real process groups, each case against one process computing the whole sequence.

One spawn of 4 CPU processes runs the grid: the kernel at cp=2 (inside a 2 x 2 data x context mesh) and cp=4
(a 1-D mesh), with multi-head and grouped-query attention, with and without left/right padding, against causal
SDPA on the whole sequence (outputs and query/key/value gradients); the collectives of one forward and backward;
the loss as the exact global token mean (also with vocab-sharded logits under loss parallelism, and without
context parallelism); tiny Hugging Face models (Llama, Qwen3) trained one step with padded batches; and the
refusals, raised alike on every rank before any collective.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from harness import PG_TIMEOUT
from modelpar.context import (
    ContextParallelAttention,
    context_parallel_attention,
    cross_entropy,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    use_context_parallel_attention,
)

SEQ = 16


def meshes() -> dict[str, DeviceMesh]:
    dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "context_parallel"))
    dp_cp["data_parallel", "context_parallel"]._flatten("data_parallel_context_parallel")
    return {
        "cp2": dp_cp,
        "cp4": init_device_mesh("cpu", (4,), mesh_dim_names=("context_parallel",)),
        "dp4": init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",)),
    }


def padding_mask(kind: str | None, batch: int = 2) -> torch.Tensor | None:
    if kind is None:
        return None
    mask = torch.ones(batch, SEQ, dtype=torch.bool)
    if kind == "left":
        mask[0, :5] = False  # five queries with no key at all: zeros, not NaN
    else:
        mask[1, -7:] = False
    return mask


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal SDPA on the whole sequence, queries with no key giving zeros (as the kernel promises)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    seen = allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~seen)
    return out.masked_fill(~seen, 0.0)


def case_layout(mesh: DeviceMesh) -> dict[str, bool]:
    """``shard_sequence`` takes the positions ``load_balanced_positions`` names; ``unshard_sequence`` inverts it."""
    from modelpar.context import load_balanced_positions

    cp = mesh["context_parallel"]
    x = torch.arange(2 * 3 * SEQ, dtype=torch.float32).view(2, SEQ, 3)
    xt = x.transpose(0, 1).contiguous()
    shard = shard_sequence(x, mesh)
    positions = load_balanced_positions(SEQ, cp.size(), cp.get_local_rank())
    batch = shard_batch({"input_ids": x[..., 0].long()}, mesh)
    return {
        "positions": bool(torch.equal(shard, x[:, positions])),
        "position_ids": bool(torch.equal(batch["position_ids"], positions.expand(2, -1))),
        "round_trip": bool(torch.equal(unshard_sequence(shard, mesh), x)),
        "round_trip_dim0": bool(torch.equal(unshard_sequence(shard_sequence(xt, mesh, dim=0), mesh, dim=0), xt)),
    }


def case_kernel(mesh: DeviceMesh, kv_heads: int, padding: str | None) -> dict[str, float]:
    """Max deviation of output and q/k/v gradients from the one-process reference (same seeds on every rank)."""
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, h, SEQ, 8) for h in (4, kv_heads, kv_heads, 4))
    mask = padding_mask(padding)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, mask)
    (ref * grad).sum().backward()
    local = [shard_sequence(t, mesh, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, mesh, key_padding_mask=mask)
    (out * shard_sequence(grad, mesh, dim=2)).sum().backward()
    errors = {"out": (out - shard_sequence(ref, mesh, dim=2)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, leaves, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        errors[name] = (mine.grad - shard_sequence(theirs.grad, mesh, dim=2)).abs().max().item()
    errors["nan"] = float(bool(out.isnan().any() or any(t.grad.isnan().any() for t in local)))  # type: ignore[union-attr]
    return errors


def case_collectives(mesh: DeviceMesh) -> dict[str, Any]:
    """The collectives of one forward + backward, and the bytes each rank receives in the gathers."""
    local = [torch.randn(2, h, SEQ // 4, 8, requires_grad=True) for h in (4, 2, 2)]
    with CommDebugMode() as comm:
        out = context_parallel_attention(*local, mesh)
        forward = {str(op): n for op, n in comm.get_comm_counts().items()}
        out.sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    kv_bytes = 2 * local[1].numel() * local[1].element_size() * (mesh.size() - 1)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        context_parallel_attention(*local, mesh)
    return {"forward": forward, "total": counts, "gathered_bytes": kv_bytes, "saved": sorted(saved.values())}


def case_loss(mesh: DeviceMesh, *, tensor_parallel: bool = False) -> dict[str, float]:
    """A tiny LM head: averaged gradients and averaged loss equal the global token mean on one process.

    Every data-parallel group gets its own samples; ignored labels differ per rank, so ranks hold different
    token counts.
    """
    torch.manual_seed(1)
    vocab, dim = 8, 6
    head = nn.Linear(dim, vocab, bias=False)
    dp = mesh["data_parallel"].size() if "data_parallel" in (mesh.mesh_dim_names or ()) else 1
    x = torch.randn(2 * dp, SEQ, dim)
    labels = torch.randint(0, vocab, (2 * dp, SEQ))
    labels[0, 3:11] = -100
    labels[1, :2] = -100
    labels[-1, 12:] = -100
    ref = copy.deepcopy(head)
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_loss.backward()
    dp_rank = mesh["data_parallel"].get_local_rank() if dp > 1 else 0
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    batch = shard_batch({"inputs_embeds": x[rows], "labels": labels[rows]}, mesh)
    if tensor_parallel:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        from modelpar.plans import loss_parallel

        parallelize_module(head, mesh["tensor_parallel"], ColwiseParallel(use_local_output=False))
        logits = head(batch["inputs_embeds"])
        with loss_parallel(logits):
            loss = cross_entropy(logits, batch["labels"], mesh)
            loss.backward()
        assert isinstance(loss, DTensor)
        loss = loss.full_tensor()
        grad = head.weight.grad.full_tensor()  # type: ignore[union-attr]
    else:
        loss = cross_entropy(head(batch["inputs_embeds"]), batch["labels"], mesh)
        loss.backward()
        grad = head.weight.grad
    from modelpar._mesh.submeshes import token_mesh

    tokens = mesh if mesh.mesh_dim_names == ("context_parallel",) else token_mesh(mesh)
    group = tokens.get_group()
    summed = torch.stack([loss.detach(), *grad.flatten()])  # type: ignore[union-attr]
    dist.all_reduce(summed, group=group)
    summed /= tokens.size()
    return {
        "loss": (summed[0] - ref_loss.detach()).abs().item(),
        "grad": (summed[1:] - ref.weight.grad.flatten()).abs().max().item(),  # type: ignore[union-attr]
    }


def tiny_hf(family: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from hf_tiny import TINY_SIZES

    config = LlamaConfig(**TINY_SIZES) if family == "llama" else Qwen3Config(head_dim=8, **TINY_SIZES)
    torch.manual_seed(2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def case_hf(mesh: DeviceMesh, family: str, padded: bool) -> dict[str, Any]:
    """One forward + backward of a tiny HF model against the whole batch on one process.

    Every data-parallel group gets the same batch here, so the gradients averaged over all 4 ranks are the reference.
    """
    ref = tiny_hf(family)
    model = copy.deepcopy(ref)
    use_context_parallel_attention(model, mesh)
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[1, -4:] = 0  # right padding
    # Unpadded batches come without a mask (the model then sees attention_mask=None).
    inputs = {"input_ids": ids, "attention_mask": mask} if padded else {"input_ids": ids}
    batch = shard_batch(inputs, mesh, shift_labels=True)
    ref_logits = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_labels = shard_batch({"input_ids": ids, "attention_mask": mask}, None, shift_labels=True)["labels"]
    F.cross_entropy(ref_logits.flatten(0, 1), ref_labels.flatten()).backward()
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        use_cache=False,
    ).logits
    whole = unshard_sequence(logits.detach(), mesh)
    real = mask.bool()
    cross_entropy(logits, batch["labels"], mesh).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    dist.all_reduce(grads)
    grads /= mesh.size()
    ref_grads = torch.cat([p.grad.flatten() for p in ref.parameters()])  # type: ignore[union-attr]
    return {
        "implementation": model.config._attn_implementation,
        "logits": (whole[real] - ref_logits.detach()[real]).abs().max().item(),
        "grads": (grads - ref_grads).abs().max().item(),
    }


def case_refusals(mesh: DeviceMesh) -> dict[str, str]:
    """Each bad input's (type, message), raised before any collective (the grid would hang otherwise)."""
    from modelpar.context._hf import KERNEL_ATTRIBUTE, _hf_attention

    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    module = nn.Module()
    setattr(module, KERNEL_ATTRIBUTE, ContextParallelAttention(mesh))
    attempts: dict[str, Any] = {
        "odd_length": lambda: context_parallel_attention(q, k, k, mesh),
        "gqa": lambda: context_parallel_attention(q[:, :, :2], q[:, :3, :2], q[:, :3, :2], mesh),
        "mask_dtype": lambda: context_parallel_attention(
            q[:, :, :2], k[:, :, :2], k[:, :, :2], mesh, key_padding_mask=torch.ones(1, 8)
        ),
        "mask_4d": lambda: context_parallel_attention(
            q[:, :, :2], k[:, :, :2], k[:, :, :2], mesh, key_padding_mask=torch.ones(1, 1, 2, 8, dtype=torch.bool)
        ),
        "batch_length": lambda: shard_batch({"input_ids": torch.zeros(1, 12, dtype=torch.long)}, mesh),
        "hf_dropout": lambda: _hf_attention(module, q[:, :, :2], k[:, :, :2], k[:, :, :2], None, dropout=0.1),
        "hf_softcap": lambda: _hf_attention(module, q[:, :, :2], k[:, :, :2], k[:, :, :2], None, softcap=30.0),
        "hf_sliding": lambda: _hf_attention(module, q[:, :, :2], k[:, :, :2], k[:, :, :2], None, sliding_window=4),
        "hf_mask_4d": lambda: _hf_attention(
            module, q[:, :, :2], k[:, :, :2], k[:, :, :2], torch.ones(1, 1, 2, 8, dtype=torch.bool)
        ),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    dist.barrier()  # every rank is still in step: nothing hung in a collective
    return out


def grid() -> dict[str, Any]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    m = meshes()
    cases: dict[str, Any] = {}
    for cp in ("cp2", "cp4"):
        cases[f"layout/{cp}"] = (case_layout, (m[cp],))
        for kv in (4, 2):
            for padding in (None, "left", "right"):
                cases[f"kernel/{cp}/kv{kv}/{padding}"] = (case_kernel, (m[cp], kv, padding))
    cases["collectives/cp4"] = (case_collectives, (m["cp4"],))
    cases["loss/cp2"] = (case_loss, (m["cp2"],))
    cases["loss/cp4"] = (case_loss, (m["cp4"],))
    cases["loss/dp4"] = (case_loss, (m["dp4"],))
    for family in ("llama", "qwen3"):
        for padded in (False, True):
            cases[f"hf/{family}/padded={padded}"] = (case_hf, (m["cp4"], family, padded))
    cases["hf/llama/cp2_in_2x2/padded=True"] = (case_hf, (m["cp2"], "llama", True))
    cases["refusals"] = (case_refusals, (m["cp4"],))
    results: dict[str, Any] = {}
    for name, (fn, args) in cases.items():
        start = time.perf_counter()
        results[name] = fn(*args)
        results[name + "/seconds"] = round(time.perf_counter() - start, 2)
    dp_cp_tp = init_device_mesh(
        "cpu", (1, 2, 2), mesh_dim_names=("data_parallel", "context_parallel", "tensor_parallel")
    )
    dp_cp_tp["data_parallel", "context_parallel"]._flatten("data_parallel_context_parallel")
    results["loss/cp2_tp2_loss_parallel"] = case_loss(dp_cp_tp, tensor_parallel=True)
    return results


@pytest.fixture(scope="module")
def results(context_parallel_spawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This module's part of the context-parallel spawn (``tests/distributed/conftest.py``)."""
    return [rank["kernel"] for rank in context_parallel_spawn]


def _cases(results: list[dict[str, Any]], prefix: str) -> list[tuple[int, str, Any]]:
    return [
        (rank, name, value)
        for rank, r in enumerate(results)
        for name, value in r.items()
        if name.startswith(prefix) and not name.endswith("/seconds")
    ]


def test_shards_hold_the_load_balanced_positions_and_unshard_restores_global_order(
    results: list[dict[str, Any]],
) -> None:
    cases = _cases(results, "layout/")
    assert len(cases) == 4 * 2
    for rank, name, checks in cases:
        assert all(checks.values()), (rank, name, checks)


def test_kernel_matches_whole_sequence_causal_sdpa_with_mha_gqa_and_padding(results: list[dict[str, Any]]) -> None:
    cases = _cases(results, "kernel/")
    assert len(cases) == 4 * 12
    for rank, name, errors in cases:
        assert errors.pop("nan") == 0.0, (rank, name)
        assert max(errors.values()) < 1e-5, (rank, name, errors)


def test_one_forward_and_backward_gathers_k_and_v_once_and_reduce_scatters_their_gradients(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        comm = r["collectives/cp4"]
        assert comm["forward"] == {"c10d_functional.all_gather_into_tensor": 2}
        assert comm["total"] == {
            "c10d_functional.all_gather_into_tensor": 2,
            "c10d_functional.reduce_scatter_tensor": 2,
        }
        # Key/value-heads sized: 2 tensors x (2 batch x 2 kv heads x 4 tokens x 8 dims x 4 bytes) x 3 peers.
        assert comm["gathered_bytes"] == 2 * 2 * 2 * 4 * 8 * 4 * 3
        # Saved for backward: the whole sequence's keys and values, key/value-heads sized (2 x 2 x 16 x 8 x 4 bytes
        # each), and nothing larger (no copy expanded to the 4 query heads).
        assert comm["saved"][-2:] == [2 * 2 * 16 * 8 * 4] * 2


@pytest.mark.parametrize("case", ["loss/cp2", "loss/cp4", "loss/dp4", "loss/cp2_tp2_loss_parallel"])
def test_loss_is_the_global_token_mean_with_uneven_token_counts(results: list[dict[str, Any]], case: str) -> None:
    for r in results:
        assert r[case]["loss"] < 1e-6, r[case]
        assert r[case]["grad"] < 1e-6, r[case]


def test_hf_llama_and_qwen3_train_like_one_process_with_padded_batches(results: list[dict[str, Any]]) -> None:
    cases = _cases(results, "hf/")
    assert len(cases) == 4 * 5
    for rank, name, out in cases:
        assert out.pop("implementation") == "modelpar_context_parallel", (rank, name)
        assert max(out.values()) < 1e-5, (rank, name, out)


def test_bad_input_is_refused_alike_on_every_rank_before_any_collective(results: list[dict[str, Any]]) -> None:
    refusals = [r["refusals"] for r in results]
    assert all(r == refusals[0] for r in refusals)
    expected = {
        "odd_length": r"ValueError: The global sequence \(4 ranks x 3 local tokens\) has length 12.*multiple of 8",
        "gqa": r"ValueError: 4 query heads cannot share 3 key/value heads",
        "mask_dtype": r"ValueError: `key_padding_mask` has dtype torch.float32, but it must be bool",
        "mask_4d": r"ValueError: `key_padding_mask` has shape \(1, 1, 2, 8\).*\(1, 8\)",
        "batch_length": r"ValueError: The batch's sequence has length 12.*Pad the sequences to a multiple of 8",
        "hf_dropout": r"NotImplementedError: Attention dropout \(0.1\) is not supported",
        "hf_softcap": r"NotImplementedError: Module asks for soft-capped or non-causal attention",
        "hf_sliding": r"NotImplementedError: Module uses sliding-window attention \(window 4\) on a sequence of 8",
        "hf_mask_4d": r"ValueError: The attention mask .* is \(1, 1, 2, 8\), but only a 2-D padding mask",
    }
    import re

    for name, pattern in expected.items():
        assert re.match(pattern, refusals[0][name]), (name, refusals[0][name])
