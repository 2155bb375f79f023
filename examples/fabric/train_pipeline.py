"""Pipeline parallelism with Fabric: the Llama plan at pp=2 x dp=2 on 4 CPU processes, resumed at pp=1.

    python examples/fabric/train_pipeline.py --checkpoint-dir /tmp/pp             # pp=2 x dp=2, saves at step 3
    python examples/fabric/train_pipeline.py --checkpoint-dir /tmp/pp --pipeline 1 --resume   # dp=4, from step 3

With ``pipeline_parallel_size=2`` the strategy cuts the model in two (embedding and the first blocks on one stage,
the last blocks, norm and output on the other, balanced by cost), applies ``LLAMA_PLAN`` (FSDP over the two
data-parallel ranks) to each stage, and ``strategy.pipeline_step`` runs the 1F1B schedule over 4 micro-batches:
forward and backward together, returning the global batch's mean loss on every rank. The checkpoint is a
distributed one whose names are the unsplit model's, so the second run loads it with no pipeline at all (FSDP
over 4 ranks), trains the same steps again, and checks that its losses repeat the first run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN

CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
GLOBAL_BATCH, SEQ = 16, 32


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic arithmetic token sequences, a pure function of the step (a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g) * torch.arange(SEQ + 1)) % CONFIG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--pipeline", type=int, default=2, help="pipeline_parallel_size (data parallel takes the rest)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    strategy = ModelParallelStrategy(
        LLAMA_PLAN, pipeline_parallel_size=args.pipeline, tensor_parallel_size=1, pipeline_microbatches=4
    )
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)  # on the meta device: each rank allocates only its stages
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    dp = strategy.device_mesh["data_parallel"]
    rows = slice(dp.get_local_rank() * GLOBAL_BATCH // dp.size(), (dp.get_local_rank() + 1) * GLOBAL_BATCH // dp.size())

    checkpoint = args.checkpoint_dir / "step-3"
    first = 1
    if args.resume:
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        first = args.save_at + 1
        mesh = strategy.device_mesh
        shape = dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))
        fabric.print(f"resumed from {checkpoint} at pp={args.pipeline} (mesh {shape})")
    losses = {}
    for step in range(first, args.steps + 1):
        x, y = (t[rows] for t in batch(step))
        if args.pipeline > 1:
            loss = strategy.pipeline_step(model, x, y, lm_loss)  # forward + backward over 4 micro-batches
        else:
            loss = lm_loss(model(x), y)
            fabric.backward(loss)
            loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # one norm over every stage
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(loss)
        fabric.print(f"step {step:3d} | loss {losses[step]:.4f}")
        if step == args.save_at and not args.resume:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    record = args.checkpoint_dir / "losses.json"
    if args.resume:
        before = {int(k): v for k, v in json.loads(record.read_text()).items()}
        same = all(abs(before[s] - losses[s]) < 1e-4 for s in losses)
        fabric.print(f"losses after resuming at pp={args.pipeline} match the first run: {same}")
    elif fabric.global_rank == 0:
        record.write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
