"""2-D parallel training with the Lightning Trainer: data_parallel=2 x tensor_parallel=2 on 4 CPU processes.

    python examples/trainer/train_llama.py                 # fit 6 steps, checkpoint every 2, validate
    python examples/trainer/train_llama.py --resume        # continue from the last checkpoint to 10 steps

The LightningModule builds its model in ``configure_model`` and shards it with the ready-made Llama plan
using ``self.device_mesh``. Gradient accumulation (2 micro-batches) skips the reduce-scatter on the first
micro-batch, and ``gradient_clip_val`` clips by the global norm across meshes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama
from modelpar.trainer import ModelParallelStrategy

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384, max_seq_len=128)


def arithmetic_sequences(n: int, seq_len: int, vocab: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LlamaLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Llama | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # already built and sharded (e.g. validate after fit)
            return
        with torch.device("meta"):  # no memory until sharded; the strategy materializes each shard
            self.model = Llama(CONFIG)
        parallelize_llama(self.model, self.device_mesh)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)  # type: ignore[misc]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/trainer-demo"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    pl.seed_everything(42)
    checkpoints = ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=10 if args.resume else 6,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        callbacks=[checkpoints],
        logger=False,
        limit_val_batches=2,
        val_check_interval=4,
        enable_progress_bar=False,
    )
    train = DataLoader(arithmetic_sequences(512, 64, CONFIG.vocab_size, seed=0), batch_size=8)
    val = DataLoader(arithmetic_sequences(64, 64, CONFIG.vocab_size, seed=1), batch_size=8)
    ckpt_path = args.checkpoint_dir / "last.ckpt" if args.resume else None
    trainer.fit(LlamaLM(), train, val, ckpt_path=ckpt_path)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(f"finished at step {trainer.global_step}: {metrics}")
        print(f"checkpoints: {sorted(p.name for p in args.checkpoint_dir.iterdir())}")


if __name__ == "__main__":
    main()
