"""Train a small mixture-of-experts Llama with expert parallelism, then resume it on another expert layout.

The MoE variant of ``modelpar.models.Llama`` (8 experts per layer, top-2, dropless routing) on 4 CPU processes
(gloo) by default: 4 data-parallel ranks, of which ``--expert-parallel`` hold different experts (``docs/moe.md``).
Tokens go to their experts by all-to-all; the loss adds the model's auxiliary losses (load balancing and router
z-loss, over the global batch)::

    python examples/fabric/train_moe.py                                  # EP=2: train, checkpoint at --save-at
    python examples/fabric/train_moe.py --resume --expert-parallel 4     # resume with the experts split 4 ways

The first run records its loss per step next to the checkpoint; the resumed run loads the checkpoint into the
other layout (checkpoints do not depend on it), continues with the same data and reports whether it reproduces
those losses. It also prints how many tokens each expert of the first MoE layer received at the last step.
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
from modelpar.plans import LLAMA_MOE_PLAN

CONFIG = LlamaConfig(
    vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=128,
    n_experts=8, top_k=2, moe_hidden=128,
)  # fmt: skip


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
    parser.add_argument("--expert-parallel", type=int, default=2, help="ranks that split each layer's experts")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=4, help="step after which the checkpoint is written")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/moe"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    strategy = ModelParallelStrategy(
        LLAMA_MOE_PLAN, data_parallel_size="auto", tensor_parallel_size=1, expert_parallel_size=args.expert_parallel
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    mesh = strategy.device_mesh
    fabric.print(f"mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))}")

    with fabric.init_module(empty_init=True):  # meta device: no memory until sharded
        model = Llama(CONFIG)
    model = fabric.setup_module(model)  # experts split over the expert axis, then FSDP2, then materialized
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))

    ckpt_path = args.checkpoint_dir / "step-checkpoint"
    record_path = args.checkpoint_dir / "losses.json"
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(ckpt_path, state)
        fabric.print(
            f"resumed from {ckpt_path} at step {state['step']} with expert_parallel_size={args.expert_parallel}"
        )

    dp = strategy.distributed_sampler_kwargs
    per_rank = args.batch_size // dp["num_replicas"]
    losses: dict[int, float] = {}
    for step in range(state["step"] + 1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch_for_step(step, args.batch_size, args.seq_len, CONFIG.vocab_size)
        rows = slice(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank)
        x, y = x[rows].to(fabric.device), y[rows].to(fabric.device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        aux = model.aux_loss if model.aux_loss is not None else torch.zeros(())  # the global batch's, on every rank
        fabric.backward(loss + aux)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = fabric.all_reduce(loss.detach()).item() + aux.item()
        losses[step] = global_loss
        tokens_per_s = args.batch_size * args.seq_len / (time.perf_counter() - t0)
        fabric.print(f"step {step:3d} | loss {global_loss:.4f} (aux {aux.item():.4f}) | {tokens_per_s:8.0f} tokens/s")
        if not args.resume and step == args.save_at:
            state["step"] = step
            fabric.save(ckpt_path, state)
            fabric.print(f"saved checkpoint at step {step} to {ckpt_path}")
    counts = model.module.layers[0].moe.expert_counts
    fabric.print(f"tokens per expert in layer 0 at the last step: {counts.long().tolist()}")

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
