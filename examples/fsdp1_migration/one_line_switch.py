"""A Fabric script written for Lightning's FSDPStrategy (FSDP1), moved to FSDP2 by changing the strategy's class.

    python examples/fsdp1_migration/one_line_switch.py                 # 2 CPU processes; checkpoint in a temp dir
    python examples/fsdp1_migration/one_line_switch.py --out /tmp/run  # keep the checkpoint in /tmp/run

Everything but the strategy's class is the FSDP1 script as it was: the wrap policy, the activation checkpointing
policy, the sharding strategy and the checkpoint format are FSDPStrategy's own arguments, and modelpar's
ModelParallelStrategy takes them under the same names (docs/migrating-from-fsdp1.md has the table). It shards
each TransformerBlock, then the root, with FSDP2 over both processes and recomputes the blocks' activations in
backward. The script trains 5 steps, saving a sharded checkpoint after step 3, then loads that checkpoint into a
fresh model and optimizer, trains steps 4 and 5 again, and checks that the losses repeat.

(Lightning refuses its FSDPStrategy on the CPU, so the FSDP1 original ran with ``accelerator="cuda"``; modelpar
runs on either.)
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric

# before: from lightning_fabric.strategies import FSDPStrategy
from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.models.llama import TransformerBlock

CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 5, 3, 8, 32


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic arithmetic token sequences, a pure function of the step (a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g) * torch.arange(SEQ + 1)) % CONFIG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train(fabric: Fabric, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = (t[fabric.global_rank :: fabric.world_size].to(fabric.device) for t in batch(step))
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    return losses


def setup(fabric: Fabric) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    # before: strategy = FSDPStrategy(
    strategy = ModelParallelStrategy(
        auto_wrap_policy={TransformerBlock},
        activation_checkpointing_policy={TransformerBlock},
        sharding_strategy="FULL_SHARD",
        state_dict_type="sharded",
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    # Every rank writes its shards into the same folder: rank 0 chooses it.
    chosen = args.out or (Path(tempfile.mkdtemp(prefix="one-line-switch-")) if fabric.global_rank == 0 else None)
    out: Path = fabric.broadcast(chosen)
    ckpt = out / f"step-{SAVE_AT}"

    model, optimizer = setup(fabric)
    losses = train(fabric, model, optimizer, range(1, SAVE_AT + 1))
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
    losses += train(fabric, model, optimizer, range(SAVE_AT + 1, STEPS + 1))

    model, optimizer = setup(fabric)  # a fresh model and optimizer, filled from the checkpoint
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(ckpt, state)
    resumed = train(fabric, model, optimizer, range(state["step"] + 1, STEPS + 1))

    fabric.print(f"losses, steps 1-{STEPS}: {[round(loss, 5) for loss in losses]}")
    fabric.print(f"after loading {ckpt}, steps {SAVE_AT + 1}-{STEPS}: {[round(loss, 5) for loss in resumed]}")
    same = max(abs(a - b) for a, b in zip(losses[SAVE_AT:], resumed, strict=True)) < 1e-5
    fabric.print(f"the loaded run repeats the losses: {same}")
    fabric.barrier()
    if args.out is None and fabric.global_rank == 0:
        shutil.rmtree(out)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
