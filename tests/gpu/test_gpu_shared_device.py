"""2 and 4 processes sharing the one GPU over gloo: the multi-rank logic on CUDA tensors, standalone.

NCCL refuses two ranks on one GPU, so these ranks talk over gloo while their tensors live on ``cuda:0``
(every rank's root device; the standalone strategy is given the devices, the environment and the backend).
First each spawn probes which collectives gloo runs on CUDA tensors (printed by the suite); a case that needs
one it cannot run is skipped with that reason. Checked against one-process CUDA builds: each rank's shard
after meta-device init (2x1, 1x2, 2x2, HSDP 2x2x1), training, CPU offload, clipping, full-file streaming
(``torch.cuda.max_memory_allocated`` per rank), async distributed saves resharded on load, and ``compile``
with tensor parallelism.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gpu_common import SkipCase, check, device, full, max_abs_diff, on_cuda, reference, run_cases
from torch import nn
from torch.distributed.tensor import distribute_tensor

from harness import PG_TIMEOUT, run_distributed
from modelpar import ModelParallelStrategy, clip_grad_norm
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN, parallelize_llama
from parity import CFG, global_batches, lm_loss

#: A model big enough for memory figures to mean something (about 17M parameters, 67 MB in fp32).
BIG = LlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=64)
STEPS = 3
ATOL = 2e-5


def _strategy(dp: int, tp: int, plan: Any = parallelize_llama, **kwargs: Any) -> ModelParallelStrategy:
    from lightning_fabric.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning_fabric.plugins.environments import LightningEnvironment

    world = int(os.environ["WORLD_SIZE"])
    strategy = ModelParallelStrategy(
        plan,
        dp,
        tp,
        process_group_backend="gloo",
        timeout=PG_TIMEOUT,
        accelerator=CUDAAccelerator() if on_cuda() else CPUAccelerator(),
        parallel_devices=[device()] * world,
        cluster_environment=LightningEnvironment(),
        **kwargs,
    )
    strategy.setup_environment()
    return strategy


def _reference(cfg: LlamaConfig = CFG, *, built_on_cpu: bool = False) -> Llama:
    return reference(cfg, built_on_cpu=built_on_cpu)


def _sharded(strategy: ModelParallelStrategy, cfg: LlamaConfig = CFG, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Llama(cfg)
    return strategy.setup_module(model)


_full = full


def _local_batch(strategy: ModelParallelStrategy, t: torch.Tensor) -> torch.Tensor:
    kw = strategy.distributed_sampler_kwargs
    per = t.shape[0] // kw["num_replicas"]
    return t[kw["rank"] * per : (kw["rank"] + 1) * per].to(device())


def _train_like_reference(strategy: ModelParallelStrategy, model: nn.Module, ref: nn.Module) -> float:
    """STEPS AdamW steps on both (each rank its data-parallel slice); the largest weight difference after."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in global_batches(STEPS):
        lm_loss(model(_local_batch(strategy, x)), _local_batch(strategy, y)).backward()
        lm_loss(ref(x.to(device())), y.to(device())).backward()
        for opt in (optimizer, ref_opt):
            opt.step()
            opt.zero_grad()
    refs = dict(ref.named_parameters())
    return max(max_abs_diff(_full(p), refs[n]) for n, p in model.named_parameters())


_SUPPORT: dict[str, str] = {}


def _needs(*collectives: str) -> None:
    missing = [c for c in collectives if _SUPPORT.get(c) != "ok"]
    if on_cuda() and missing:
        raise SkipCase(
            f"gloo cannot run {', '.join(missing)} on CUDA tensors in torch {torch.__version__}"
            f" ({'; '.join(f'{c}: {_SUPPORT.get(c)}' for c in missing)}); the CPU suite covers this logic"
        )


# ---------------------------------------------------------------------------------------------------
# cases (inside every rank)
# ---------------------------------------------------------------------------------------------------
def case_gloo_cuda_collectives() -> dict[str, Any]:
    """Which collectives gloo runs on this device's tensors (figures only; the other cases consult them)."""
    if not dist.is_initialized():
        _strategy(int(os.environ["WORLD_SIZE"]), 1)  # creates the process group
    ws, dev = dist.get_world_size(), device()
    x = torch.ones(8 * ws, device=dev)
    probes = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(ws)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8 * ws * ws, device=dev), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8, device=dev), x.clone()),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "bf16_all_reduce": lambda: dist.all_reduce(x.to(torch.bfloat16)),
        "bf16_reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(8, device=dev, dtype=torch.bfloat16), x.to(torch.bfloat16)
        ),
        "barrier": lambda: dist.barrier(),
    }
    for name, probe in probes.items():
        try:
            probe()
            if on_cuda():
                torch.cuda.synchronize()
            _SUPPORT[name] = "ok"
        except Exception as error:  # a collective gloo lacks raises the same on every rank
            _SUPPORT[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return {"torch": torch.__version__, **_SUPPORT}


def _layouts() -> list[tuple[int, int, int]]:
    """(replicate, dp, tp) per world size: plain FSDP, TP, FSDP x TP, and HSDP on 4 ranks."""
    return {2: [(1, 2, 1), (1, 1, 2)], 4: [(1, 2, 2), (2, 4, 1)]}[dist.get_world_size()]


def case_meta_init_shards_equal_the_one_process_cuda_build() -> dict[str, Any]:
    _needs("all_reduce")  # the ranks' random-state digests are exchanged as objects
    ref = _reference()
    checked = {}
    for replicate, dp, tp in _layouts():
        strategy = _strategy(dp, tp, data_parallel_replicate_size=replicate)
        model = _sharded(strategy)
        differing = []
        for name, p in model.named_parameters():
            want = distribute_tensor(
                dict(ref.named_parameters())[name].detach(), p.device_mesh, p.placements, src_data_rank=None
            )
            if not torch.equal(p.to_local(), want.to_local()):
                differing.append(name)
        assert not differing, f"{replicate}x{dp}x{tp} rank {dist.get_rank()}: not bit for bit: {differing}"
        checked[f"{replicate}x{dp}x{tp}"] = "bit for bit"
    return checked


def case_training_matches_the_one_process_cuda_model() -> dict[str, Any]:
    _needs("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce")
    figures = {}
    for replicate, dp, tp in _layouts():
        strategy = _strategy(dp, tp, data_parallel_replicate_size=replicate)
        worst = _train_like_reference(strategy, _sharded(strategy), _reference())
        assert worst <= ATOL * 10, worst
        figures[f"{replicate}x{dp}x{tp}"] = worst
    return figures


def case_cpu_offload_standalone_with_meta_init() -> dict[str, Any]:
    _needs("reduce_scatter_tensor", "all_gather_into_tensor")
    strategy = _strategy(dist.get_world_size(), 1, cpu_offload=True)
    model = _sharded(strategy)
    assert all(p.device.type == "cpu" and p.to_local().device.type == "cpu" for p in model.parameters())
    worst = _train_like_reference(strategy, model, _reference(built_on_cpu=True))
    assert worst <= 1e-3, worst
    return {"weight_diff": worst}


def case_clipping_matches_torch() -> dict[str, Any]:
    _needs("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce")
    figures = {}
    for replicate, dp, tp in _layouts():
        strategy = _strategy(dp, tp, data_parallel_replicate_size=replicate)
        model, ref = _sharded(strategy), _reference()
        x, y = global_batches(1)[0]
        lm_loss(model(_local_batch(strategy, x)), _local_batch(strategy, y)).backward()
        lm_loss(ref(x.to(device())), y.to(device())).backward()
        norm = clip_grad_norm(model.parameters(), max_norm=0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (float(norm), float(ref_norm))
        refs = dict(ref.named_parameters())
        worst = max(max_abs_diff(_full(p.grad), refs[n].grad) for n, p in model.named_parameters())
        assert worst <= 1e-6, worst
        figures[f"{replicate}x{dp}x{tp}"] = {"norm": float(norm), "grad_diff": worst}
    return figures


def _shared_tmp() -> Path:
    """One temporary folder every rank agrees on (rank 0 creates it)."""
    holder = [tempfile.mkdtemp(prefix="modelpar-gpu-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])  # type: ignore[arg-type]


def case_full_file_streams_into_shards_with_little_gpu_memory() -> dict[str, Any]:
    _needs("all_gather_into_tensor")
    ws = dist.get_world_size()
    root = _shared_tmp()
    saver = _strategy(ws, 1, save_distributed_checkpoint=False)
    source = _sharded(saver, BIG)
    saver.save_checkpoint(root / "full.ckpt", {"model": source})
    loader = _strategy(ws, 1)
    target = _sharded(loader, BIG, seed=1)
    largest = max(p.numel() * p.element_size() for p in source.parameters())
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in target.parameters())
    if on_cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    loader.load_checkpoint(root / "full.ckpt", {"model": target})
    figures: dict[str, Any] = {"largest_tensor_mb": largest / 2**20, "shard_mb": shard_bytes / 2**20}
    if on_cuda():
        extra = torch.cuda.max_memory_allocated() - before
        figures["peak_extra_gpu_mb"] = extra / 2**20
        assert extra <= 2 * largest, f"loading a full file took {extra / 2**20:.1f} MB of GPU memory beyond the shards"
    for (n, a), b in zip(source.named_parameters(), target.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local()), n
    return figures


def case_async_distributed_save_reshards_on_load() -> dict[str, Any]:
    _needs("all_gather_into_tensor", "reduce_scatter_tensor")
    ws = dist.get_world_size()
    root = _shared_tmp()
    saver = _strategy(ws, 1, async_save=True)
    model = _sharded(saver)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(global_batches(2)):
        lm_loss(model(_local_batch(saver, x)), _local_batch(saver, y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        saver.save_checkpoint(root / f"step-{i}", {"model": model, "optimizer": optimizer})
    same = _sharded(saver, seed=9)
    saver.load_checkpoint(root / "step-1", {"model": same}, strict=False)  # waits for the background writes
    for (n, a), b in zip(model.named_parameters(), same.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local()), n
    loader = _strategy(1, ws)  # another layout: tensor parallel over the same ranks
    back = _sharded(loader, seed=3)
    loader.load_checkpoint(root / "step-1", {"model": back}, strict=False)
    for (n, a), b in zip(model.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(_full(a), _full(b)), n
    return {"saved": 2, "resharded": f"{ws}x1 -> 1x{ws}"}


def case_compile_with_tensor_parallel() -> dict[str, Any]:
    _needs("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    ws = dist.get_world_size()
    strategy = _strategy(1, ws, plan=LLAMA_PLAN.replace(compile=True))
    model, ref = _sharded(strategy), _reference()
    worst = 0.0
    for x, y in global_batches(2):
        loss = lm_loss(model(x.to(device())), y.to(device()))
        ref_loss = lm_loss(ref(x.to(device())), y.to(device()))
        loss.backward()
        ref_loss.backward()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    assert worst <= 1e-4, worst
    return {"loss_diff": worst}


CASES = {
    "gloo_cuda_collectives": case_gloo_cuda_collectives,
    "meta_init_shards": case_meta_init_shards_equal_the_one_process_cuda_build,
    "training": case_training_matches_the_one_process_cuda_model,
    "offload_standalone": case_cpu_offload_standalone_with_meta_init,
    "clipping": case_clipping_matches_torch,
    "stream_full_file": case_full_file_streams_into_shards_with_little_gpu_memory,
    "async_reshard": case_async_distributed_save_reshards_on_load,
    "compile_tp": case_compile_with_tensor_parallel,
}
FOUR_RANK_CASES = ["gloo_cuda_collectives", "meta_init_shards", "training", "clipping"]


def grid(names: list[str] | None) -> dict[str, Any]:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks share the machine's cores
    return run_cases(CASES, names)


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(grid, 2, None, timeout=1200)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(grid, 4, FOUR_RANK_CASES, timeout=1200)


def test_gloo_collectives_on_cuda_tensors_are_reported(two: list[dict[str, Any]]) -> None:
    figures = check(two, "gloo_cuda_collectives")
    assert figures["all_reduce"] == "ok", figures  # everything multi-rank below needs at least this


@pytest.mark.parametrize("world", [2, 4])
def test_meta_init_gives_each_rank_its_slice_of_the_one_process_cuda_build(world: int, request: Any) -> None:
    check(request.getfixturevalue({2: "two", 4: "four"}[world]), "meta_init_shards")


@pytest.mark.parametrize("world", [2, 4])
def test_training_on_a_shared_gpu_matches_the_one_process_model(world: int, request: Any) -> None:
    check(request.getfixturevalue({2: "two", 4: "four"}[world]), "training")


@pytest.mark.parametrize("world", [2, 4])
def test_clipping_on_cuda_gradients_matches_torch(world: int, request: Any) -> None:
    check(request.getfixturevalue({2: "two", 4: "four"}[world]), "clipping")


def test_cpu_offload_standalone_with_meta_init_trains(two: list[dict[str, Any]]) -> None:
    check(two, "offload_standalone")


def test_full_file_streams_into_shards_with_little_gpu_memory_per_rank(two: list[dict[str, Any]]) -> None:
    check(two, "stream_full_file")


def test_async_distributed_saves_reshard_on_load(two: list[dict[str, Any]]) -> None:
    check(two, "async_reshard")


def test_compile_with_tensor_parallel_matches_the_one_process_loss(two: list[dict[str, Any]]) -> None:
    check(two, "compile_tp")
