"""Resume a run that FSDP1 (Lightning's FSDPStrategy) checkpointed, under modelpar's ModelParallelStrategy.

    python examples/fsdp1_migration/resume_fsdp1_run.py --phase fsdp1    # the old run: FSDP1, saves at step 3
    python examples/fsdp1_migration/resume_fsdp1_run.py --phase modelpar # the new run: FSDP2 + TP, resumes

The old run shards with FSDP1 over 2 processes (pure data parallel); the new one loads its sharded
checkpoint onto a 1 x 2 tensor-parallel mesh and continues. Both record their losses; the new run checks
that it continues with the losses the old run would have had (the old run keeps going to step 6 to show them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from lightning_fabric.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 6, 3, 8, 32


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, unchanged. Fabric refuses the exact type on CPU; on GPUs use FSDPStrategy."""


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g) * torch.arange(SEQ + 1)) % CONFIG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train(
    fabric: Fabric,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    first: int,
    last: int,
    data_rank: int,
    data_size: int,
    on_step=None,
) -> dict[int, float]:
    losses = {}
    per = GLOBAL_BATCH // data_size
    for step in range(first, last + 1):
        x, y = (t[data_rank * per : (data_rank + 1) * per] for t in batch(step))
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = fabric.all_reduce(loss.detach()).item()
        fabric.print(f"step {step} | loss {losses[step]:.5f}")
        if on_step:
            on_step(step)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["fsdp1", "modelpar"], required=True)
    parser.add_argument("--dir", type=Path, default=Path("checkpoints/fsdp1-migration"))
    args = parser.parse_args()
    ckpt = args.dir / "fsdp1-step3"
    args.dir.mkdir(parents=True, exist_ok=True)

    if args.phase == "fsdp1":
        # --- before: FSDP1 through Lightning's FSDPStrategy, sharded checkpoints ---------------------------
        fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(state_dict_type="sharded"))
        fabric.launch()
        torch.manual_seed(0)
        model = Llama(CONFIG)
        # On GPUs FSDPStrategy wraps for you (auto_wrap_policy={TransformerBlock}); FSDP1 on CPU needs device_id.
        for i, block in enumerate(model.layers):
            model.layers[i] = FullyShardedDataParallel(block, device_id=torch.device("cpu"), use_orig_params=True)
        model = fabric.setup_module(
            FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        )
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))

        def save(step: int) -> None:
            if step == SAVE_AT:
                fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": step})
                fabric.print(f"FSDP1 saved {ckpt}")

        losses = train(fabric, model, optimizer, 1, STEPS, fabric.global_rank, fabric.world_size, on_step=save)
        if fabric.global_rank == 0:
            (args.dir / "fsdp1-losses.json").write_text(json.dumps(losses))
        # Lightning's FSDPStrategy leaves the gloo group to interpreter shutdown, where a gloo worker thread can
        # abort the finished process (exit -6, rare); modelpar's strategy does this for you at exit.
        torch.distributed.destroy_process_group()
        time.sleep(0.02)  # let gloo's threads release their tensors while the interpreter is whole
        return

    # --- after: modelpar, FSDP2 + tensor parallelism; the checkpoint is resharded on load ----------------
    strategy = ModelParallelStrategy(parallelize_llama, data_parallel_size=1, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(ckpt, state)  # the FSDP1 folder as Lightning wrote it: weights and Adam moments
    fabric.print(f"modelpar resumed {ckpt} at step {state['step']} on a {tuple(strategy.device_mesh.shape)} mesh")
    dp = strategy.distributed_sampler_kwargs
    losses = train(fabric, model, optimizer, state["step"] + 1, STEPS, dp["rank"], dp["num_replicas"])
    if fabric.global_rank == 0:
        old = {int(k): v for k, v in json.loads((args.dir / "fsdp1-losses.json").read_text()).items()}
        diff = max(abs(old[s] - loss) for s, loss in losses.items())
        print(f"losses after resuming match the FSDP1 run's: {diff < 1e-4} (max diff {diff:.1e})")
        if diff >= 1e-4:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
