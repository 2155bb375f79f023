"""Shared pieces of the distributed tests: a tiny model, deterministic data, and reference comparisons.

Every distributed check builds a plain single-process copy of the model from the same seed, feeds it
the whole global batch, and compares losses, gradients and weights with the sharded model's values (each rank
its own shards against the same part of the reference). The sharded model sees only its data-parallel slice of
that batch.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import PG_TIMEOUT
from modelpar import ModelParallelStrategy
from modelpar._init.blocks import local_view
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

# n_heads, n_kv_heads, ffn_hidden and vocab are divisible by 4, so every layout up to 1x4 applies.
CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)
GLOBAL_BATCH = 8
SEQ = 12
ATOL, RTOL = 2e-5, 1e-4
#: AdamW's ``eps`` in every test that trains against a one-process reference (see :func:`adamw`).
PARITY_EPS = 1e-6

#: Lightning Fabric's two namespaces: the standalone package and the unified ``lightning`` package.
FABRIC_NAMESPACES = ("lightning_fabric", "lightning.fabric")
_fabric_namespace = FABRIC_NAMESPACES[0]


def use_fabric_namespace(namespace: str) -> None:
    """Which namespace's ``Fabric`` :func:`make_fabric` builds in this process (grids set it first)."""
    global _fabric_namespace
    if namespace not in FABRIC_NAMESPACES:
        raise ValueError(f"unknown Fabric namespace {namespace!r}")
    _fabric_namespace = namespace


def make_fabric(
    dp: Any,
    tp: Any,
    *,
    world_size: int,
    num_nodes: int = 1,
    precision: str = "32-true",
    parallelize_fn: Callable[..., Any] = parallelize_llama,
    **strategy_kwargs: Any,
) -> Fabric:
    strategy = ModelParallelStrategy(parallelize_fn, dp, tp, timeout=PG_TIMEOUT, **strategy_kwargs)
    fabric_cls = importlib.import_module(_fabric_namespace).Fabric
    fabric = fabric_cls(
        accelerator="cpu",
        devices=world_size // num_nodes,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
    )
    fabric.launch()
    assert type(fabric).__module__.startswith(_fabric_namespace)
    return fabric


def reference_model(seed: int = 0, cfg: LlamaConfig = CFG) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def global_batches(steps: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Arithmetic token sequences (learnable, so the loss moves): inputs and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
        step = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
        seq = (start + step * torch.arange(SEQ + 1)) % CFG.vocab_size
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def local_slice(fabric: Fabric, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global batch: split by data-parallel rank only (TP peers see the same)."""
    kw = fabric.strategy.distributed_sampler_kwargs
    per = t.shape[0] // kw["num_replicas"]
    return t[kw["rank"] * per : (kw["rank"] + 1) * per]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def mine_and_theirs(t: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of ``t`` and the same part of the whole reference tensor ``ref``, without a collective.

    A DTensor sharded or replicated is compared shard by shard, so every element is still compared, on the rank
    that holds it, at no communication (gathering every tensor instead cost a quarter of a grid's time). The part
    of the reference is the block FSDP2 holds, FSDP over TP's ``_StridedShard`` included: ``local_view``'s block
    arithmetic, checked against what FSDP2 itself holds (uneven sizes included) in ``test_meta_init_on_cpu.py``.
    Recent torch no longer makes ``_StridedShard`` a ``Shard`` subclass (2.13 does not), and cutting the reference
    with ``distribute_tensor`` (``src_data_rank=None``) reads it differently where sizes do not divide, so that path is
    left for placements the block arithmetic does not cut. A partial sum (``Partial``) is gathered.
    """
    if not isinstance(t, DTensor):
        return t, ref
    if any(p.is_partial() for p in t.placements):
        return t.full_tensor(), ref
    part = local_view(ref.detach(), t)
    if part is None:
        part = distribute_tensor(ref.detach(), t.device_mesh, t.placements, src_data_rank=None).to_local()
    return t.to_local(), part


def shard_difference(t: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``|t - ref|`` over this rank's part (:func:`mine_and_theirs`); 0.0 where it holds none."""
    got, want = mine_and_theirs(t.detach(), ref.detach())
    return (got - want).abs().max().item() if got.numel() else 0.0


def assert_matches(model: nn.Module, ref: nn.Module, what: str, atol: float = ATOL, rtol: float = RTOL) -> float:
    """Compare every parameter (``what="param"``) or gradient (``"grad"``) with the reference; return the max diff
    over this rank's part (every rank checks its own shards; together they cover every element)."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    model = getattr(model, "module", model)  # unwrap Fabric's _FabricModule
    for name, p in model.named_parameters():
        r = ref_params[name]
        mine = p.grad if what == "grad" else p
        theirs = r.grad if what == "grad" else r
        assert mine is not None and theirs is not None, f"{what} {name}: missing ({mine is None}, {theirs is None})"
        got, want = (x.detach().float() for x in mine_and_theirs(mine, theirs))
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{what} {n}: {m}")
        if got.numel():  # an uneven split can leave a rank no part of a tensor
            worst = max(worst, (got - want).abs().max().item())
    return worst


def adamw(params: Any, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with ``eps=PARITY_EPS`` (1e-6) unless given: what the parity tests train with.

    Why not torch's 1e-8: Adam divides each gradient by its own running magnitude, so a gradient made only of
    rounding noise is scaled up to an update of the learning rate's size. Such gradients are common: a key
    projection's bias gets exactly zero plus rounding (softmax ignores a shift shared by every key), and a weight
    behind an inactive unit gets 1e-9 where its neighbours get 1e-3. Their noise differs between layouts and
    between CPUs (sums run in another order, other matrix kernels). With eps=1e-8, one such weight of a Qwen3 gate
    projection (gradient 3.1e-9 at the first step, the tensor's largest 2.6e-3) ended 8.6e-5 away from the
    reference after three steps at lr=1e-2 on an AMD EPYC, four times ``ATOL``, where earlier machines had passed.
    A noise difference ``dg`` moves the weights apart by up to ``lr * dg / eps`` per step: eps=1e-6 makes that a
    hundred times smaller, while real gradients (1e-4 to 1e-2) are stepped as Adam steps them. The comparison
    stays tight and tests the sharding, not the rounding.
    """
    return torch.optim.AdamW(params, **{"eps": PARITY_EPS, **kwargs})


def setup_pair(fabric: Fabric, lr: float = 1e-2) -> tuple[Any, Any, Llama, torch.optim.Optimizer]:
    """A sharded model + optimizer through Fabric, and its single-process reference twin."""
    ref = reference_model()
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=lr, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=lr, weight_decay=0.1)
    return model, optimizer, ref, ref_opt


def lightning_style_fsdp(model: nn.Module, device_mesh: Any) -> nn.Module:
    """A ``parallelize_fn`` written for Lightning's strategy: FSDP on ``device_mesh["data_parallel"]``, no options,
    attention left alone (what HSDP and context parallelism must refuse or handle)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def fsdp_blocks_only(model: nn.Module, device_mesh: Any) -> nn.Module:
    """A ``parallelize_fn`` that shards ``model.layers`` and the root with the strategy's FSDP options and does
    nothing else: no attention kernel replaced, no experts split (what context and expert parallelism refuse)."""
    from torch.distributed.fsdp import fully_shard

    from modelpar import fsdp_kwargs

    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, **fsdp_kwargs(device_mesh))
    fully_shard(model, **fsdp_kwargs(device_mesh))
    return model


def error_text(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``: to compare the ranks' refusals."""
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model tensor and every non-scalar optimizer state, gathered whole (DTensors): layout-free, to compare."""
    whole = {f"model.{k}": v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim():
                whole[f"optim.{index}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return {k: v.detach().clone() for k, v in whole.items()}
