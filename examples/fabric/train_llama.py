"""2-D parallel training of a small Llama-style model with Fabric: data_parallel=2 x tensor_parallel=2.

Runs on 4 CPU processes (gloo) by default, or on GPUs with ``--accelerator cuda``::

    python examples/fabric/train_llama.py            # train, checkpoint at --save-at, finish
    python examples/fabric/train_llama.py --resume   # load that checkpoint, continue, compare losses

``--replicate N`` (``data_parallel_replicate_size``, default 1) splits the data-parallel ranks into N
replicas that each shard the model over the rest (HSDP, a 3-D mesh); N must divide ``--data-parallel``,
which stays the whole data-parallel size. HSDP on the 4 processes, two replicas of two shards, no TP::

    python examples/fabric/train_llama.py --data-parallel 4 --tensor-parallel 1 --replicate 2

The first run records its loss per step next to the checkpoint; the resumed run continues from the
saved step with the same data and reports whether it reproduces those losses.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=128)


def batch_for_step(step: int, batch_size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences, a pure function of the step: a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument(
        "--replicate", type=int, default=1, help="HSDP replicas (data_parallel_replicate_size); 1: plain FSDP"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", type=int, default=5, help="step after which the checkpoint is written")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/demo"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    strategy = ModelParallelStrategy(
        parallelize_llama, args.data_parallel, args.tensor_parallel, data_parallel_replicate_size=args.replicate
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    mesh = strategy.device_mesh
    fabric.print(
        f"mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))} on {fabric.world_size} processes"
    )

    with fabric.init_module(empty_init=True):  # meta device: no memory until sharded
        model = Llama(CONFIG)
    model = fabric.setup_module(model)  # tensor parallel + FSDP2, then each rank materializes its shard
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))

    ckpt_path = args.checkpoint_dir / "step-checkpoint"
    record_path = args.checkpoint_dir / "losses.json"
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(ckpt_path, state)
        fabric.print(f"resumed from {ckpt_path} at step {state['step']}")

    dp = strategy.distributed_sampler_kwargs  # tensor-parallel peers get the same slice
    per_rank = args.batch_size // dp["num_replicas"]
    losses: dict[int, float] = {}
    for step in range(state["step"] + 1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch_for_step(step, args.batch_size, args.seq_len, CONFIG.vocab_size)
        rows = slice(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank)
        x, y = x[rows].to(fabric.device), y[rows].to(fabric.device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = fabric.all_reduce(loss.detach()).item()
        losses[step] = global_loss
        tokens_per_s = args.batch_size * args.seq_len / (time.perf_counter() - t0)
        fabric.print(f"step {step:3d} | loss {global_loss:.4f} | {tokens_per_s:8.0f} tokens/s")
        if not args.resume and step == args.save_at:
            state["step"] = step
            fabric.save(ckpt_path, state)
            fabric.print(f"saved checkpoint at step {step} to {ckpt_path}")

    if fabric.global_rank == 0:
        if not args.resume:
            record_path.write_text(json.dumps(losses))
        elif record_path.is_file():
            first = {int(k): v for k, v in json.loads(record_path.read_text()).items()}
            diffs = [abs(first[s] - loss) for s, loss in losses.items() if s in first]
            same = bool(diffs) and max(diffs) < 1e-4
            print(f"loss trajectory after resume matches the first run: {same} (max diff {max(diffs):.2e})")
            if not same:
                raise SystemExit(1)


if __name__ == "__main__":
    main()
