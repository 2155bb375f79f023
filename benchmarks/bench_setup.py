"""Set-up benchmark: meta-device init -> sharded model, modelpar vs Lightning vs raw torch, in one run.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_setup.py [--repeats 7 --before-ref <git rev>]

A Llama-style model of 33.6M parameters (the ``small`` model of ``bench_checkpoint.py``) is built on the meta
device and set up on a 2 (data) x 2 (tensor) mesh with the same ``parallelize_llama``, in turns (the order
rotates every repeat, so a change in the machine's load hits all alike):

* ``lightning``: Lightning's ``ModelParallelStrategy.setup_module`` (``to_empty`` + ``reset_parameters()`` on
  the DTensors: each rank draws only its own shard, from its own stream, so the values depend on the layout);
* ``modelpar``: ours (every rank draws each full tensor as one process would, and keeps its block);
* ``raw torch``: ``parallelize_llama`` + ``to_empty`` + every module's ``reset_parameters()`` by hand (what
  Lightning does, without Fabric);
* ``eager build``: ``Llama(cfg)`` on plain CPU tensors in every rank: the draws one process makes, the floor of
  any set-up that gives every layout the one-process values (on CPU every rank has to draw them all);
* ``parallelize_llama alone``: the sharding of the meta model that every other set-up variant includes;
* ``modelpar materialize_module``: ``parallelize_llama`` + our ``materialize_module`` alone (no Fabric);
* with ``--before-ref``: the same with ``materialize_module`` of ``src/modelpar/_init/materialize.py`` at that git
  revision (a self-contained module until this change), to compare before and after in one run.

Per variant: wall time of the slowest rank, CPU time summed over the ranks (the work done: far less distorted
than the wall time on a shared machine) and the peak anonymous resident memory added on the worst rank
(``bench_checkpoint.measure``), medians over the repeats after one unmeasured round; rank 0 prints a markdown
table with ratios to Lightning and to the eager build, modelpar's CPU time against the floor of a layout-independent
set-up (the eager build plus ``parallelize_llama alone``; issue 25 holds it within 1.25x), and the 1-minute load
average before and after.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_checkpoint  # its memory sampler and model sizes (benchmarks/ is on the path when run as a script)
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from modelpar import ModelParallelStrategy
from modelpar._init.materialize import materialize_module
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama


def on_meta(cfg: LlamaConfig) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return Llama(cfg)


def fabric_setup(strategy: Any) -> Callable[[LlamaConfig], Any]:
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()

    def run(cfg: LlamaConfig) -> Any:
        with fabric.init_module(empty_init=True):
            model = on_meta(cfg)
        return fabric.setup_module(model)

    return run


def raw_torch(mesh: DeviceMesh) -> Callable[[LlamaConfig], Any]:
    def run(cfg: LlamaConfig) -> Any:
        model = parallelize_llama(on_meta(cfg), mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
        return model

    return run


def eager_build(cfg: LlamaConfig) -> Any:
    torch.manual_seed(0)
    return Llama(cfg)


def materialize_with(
    materialize: Callable[[nn.Module, torch.device], None], mesh: DeviceMesh
) -> Callable[[LlamaConfig], Any]:
    def run(cfg: LlamaConfig) -> Any:
        model = parallelize_llama(on_meta(cfg), mesh)
        materialize(model, torch.device("cpu"))
        return model

    return run


def materialize_at(ref: str, mesh: DeviceMesh) -> Callable[[LlamaConfig], Any]:
    """``parallelize_llama`` + the ``materialize_module`` of the materialization module at git revision ``ref``
    (``_init/materialize.py``; ``_materialize.py`` before the package was grouped by concept)."""
    root = Path(__file__).resolve().parent.parent
    for where in ("src/modelpar/_init/materialize.py", "src/modelpar/_materialize.py"):
        shown = subprocess.run(["git", "-C", str(root), "show", f"{ref}:{where}"], capture_output=True, text=True)
        if shown.returncode == 0:
            source = shown.stdout
            break
    else:
        raise SystemExit(f"--before-ref {ref}: no materialization module there ({shown.stderr.strip()})")
    path = Path(tempfile.mkdtemp(prefix="bench-setup-")) / f"materialize_before_rank{dist.get_rank()}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("materialize_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return materialize_with(module.materialize_module, mesh)


def measure(fn: Callable[[], Any]) -> tuple[float, int, float]:
    """(wall seconds of the slowest rank, peak added anonymous RSS of the worst rank, CPU seconds of all ranks).

    The CPU seconds are the work done, which a machine shared with other jobs distorts far less than the wall
    time (4 ranks on 2 cores wait for each other's draws).
    """
    cpu = [0.0]

    def run() -> None:
        start = time.process_time()
        fn()
        cpu[0] = time.process_time() - start

    wall, peak = bench_checkpoint.measure(run)
    total = torch.tensor([cpu[0]], dtype=torch.float64)
    dist.all_reduce(total)
    return wall, peak, float(total[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=sorted(bench_checkpoint.SIZES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before-ref", default=None, help="also time the materialization module at this git revision")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's DTensor-random and our set-up notes are not measured here
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = bench_checkpoint.config(**bench_checkpoint.SIZES[args.size])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    variants: dict[str, Callable[[LlamaConfig], Any]] = {
        "lightning": fabric_setup(LightningStrategy(parallelize_llama, 2, 2)),
        "modelpar": fabric_setup(ModelParallelStrategy(parallelize_llama, 2, 2)),
        "raw torch": raw_torch(mesh),
        "modelpar materialize_module": materialize_with(materialize_module, mesh),
        "eager build": eager_build,
        "parallelize_llama alone": lambda cfg: parallelize_llama(on_meta(cfg), mesh),
    }
    if args.before_ref:
        variants[f"modelpar at {args.before_ref}"] = materialize_at(args.before_ref, mesh)
    names = list(variants)
    before_load = bench_checkpoint.load_average()[0]
    samples: dict[str, list[tuple[float, int, float]]] = {name: [] for name in names}
    for i in range(args.repeats + 1):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            gc.collect()
            result = measure(lambda n=name: variants[n](cfg))
            if i:  # the first round warms up (lazy imports, allocator, process-group set-up)
                samples[name].append(result)
    after_load = bench_checkpoint.load_average()[0]
    if dist.get_rank() == 0:
        n_params = sum(p.numel() for p in on_meta(cfg).parameters())
        med = {name: [statistics.median(s[k] for s in v) for k in range(3)] for name, v in samples.items()}
        spread = {name: (min(s[0] for s in v), max(s[0] for s in v)) for name, v in samples.items()}
        mib = 1024 * 1024
        print(
            f"\n### set-up, {n_params / 1e6:.1f}M parameters, mesh 2x2 on {dist.get_world_size()} CPU processes (gloo),"
            f" torch {torch.__version__}, median of {args.repeats}\n"
        )
        print("| variant | wall s (min-max) | / Lightning | / eager | CPU s | / Lightning | / eager | peak MiB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        lt, eager = med["lightning"], med["eager build"]
        for name in names:
            t, peak, cpu = med[name]
            lo, hi = spread[name]
            print(
                f"| {name} | {t:.3f} ({lo:.3f}-{hi:.3f}) | {t / lt[0]:.2f} | {t / eager[0]:.2f} | {cpu:.3f}"
                f" | {cpu / lt[2]:.2f} | {cpu / eager[2]:.2f} | {peak / mib:.0f} |"
            )
        # The floor of a layout-independent set-up on CPU: every rank draws what one process draws (the eager
        # build), and the meta model is sharded as in every variant (parallelize_llama alone). Goal: within 1.25x.
        floor = eager[2] + med["parallelize_llama alone"][2]
        ours = med["modelpar"]
        print(
            f"\nfloor (eager build + parallelize_llama alone): {floor:.3f} CPU s; modelpar {ours[2]:.3f} CPU s ="
            f" {ours[2] / floor:.2f}x the floor (goal: at most 1.25x); wall {ours[0] / lt[0]:.2f}x Lightning's"
        )
        print(f"1-minute load average: {before_load:.2f} before, {after_load:.2f} after")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
