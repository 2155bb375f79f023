"""Fine-tune a Hugging Face Llama with the Lightning Trainer at data_parallel=2 x tensor_parallel=2, then export it.

    python examples/hf/finetune_trainer.py --make-tiny /tmp/tiny-llama --out /tmp/tiny-llama-tuned
    python examples/hf/finetune_trainer.py --pretrained path/to/llama --out exports/llama-tuned --accelerator cuda

Where each piece goes with the Trainer:

- ``configure_model``: build the model on the meta device and apply ``modelpar.hf.plan_for(model)`` with
  ``self.device_mesh`` (tensor parallelism from the model's own plan, FSDP2 per decoder layer). The weights
  cannot be loaded here: they are still on the meta device.
- ``init_weights`` on the LightningModule: the strategy materializes each rank's shards and calls the root
  module's ``init_weights()``; the LightningModule is the root, so it hands over to the Hugging Face model's
  own (which also computes the rotary buffers the files do not hold).
- ``on_fit_start``: after the strategy's setup, so the shards are real; ``load_pretrained`` fills them in
  place (the optimizer, already created, keeps pointing at the same parameters). When you resume with
  ``ckpt_path=``, the Trainer restores the checkpoint after ``on_fit_start``, so the checkpoint wins.
- after ``fit``: ``save_pretrained`` on every rank (collective; rank 0 writes).

``--make-tiny DIR`` writes a tiny random Llama to DIR if absent. Last, rank 0 loads the export with
``from_pretrained`` and reports whether it reproduces the trained model's logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import modelpar.hf
from modelpar.trainer import ModelParallelStrategy


def make_tiny(folder: Path) -> None:
    """A tiny random Llama saved as a pretrained folder (heads divisible by the tensor-parallel size)."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def arithmetic_sequences(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


class FineTune(pl.LightningModule):
    def __init__(self, pretrained: Path, lr: float) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.lr = lr
        self.model: Any = None
        self.loaded = False

    def configure_model(self) -> None:
        if self.model is not None:  # already built and sharded
            return
        config = AutoConfig.from_pretrained(self.pretrained)
        with torch.device("meta"):  # no memory until sharded; the strategy materializes each rank's shards
            self.model = AutoModelForCausalLM.from_config(config)
        modelpar.hf.plan_for(self.model)(self.model, self.device_mesh)

    def init_weights(self) -> None:
        """Called by the strategy after materialization (this module is the root): the HF model's own init."""
        self.model.init_weights()

    def on_fit_start(self) -> None:
        if not self.loaded:  # the shards are real now; a checkpoint given to `fit(ckpt_path=)` is restored later
            modelpar.hf.load_pretrained(self.model, self.pretrained)
            self.loaded = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pretrained", type=Path, help="a pretrained folder (config.json + safetensors)")
    source.add_argument("--make-tiny", type=Path, help="write a tiny random Llama here if absent, and use it")
    parser.add_argument("--out", type=Path, required=True, help="where to export the fine-tuned model")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    pretrained: Path = args.pretrained or args.make_tiny
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # The Trainer starts the other processes in `fit` (they run this script again), so on one machine the
    # tiny folder is complete before they look for it. (Under torchrun or SLURM, make it before launching.)
    if args.make_tiny is not None and trainer.is_global_zero and not (pretrained / "config.json").is_file():
        make_tiny(pretrained)
        print(f"wrote a tiny random Llama to {pretrained}")
    pl.seed_everything(42)  # every rank alike (making the tiny model drew from rank 0's random stream)

    config = AutoConfig.from_pretrained(pretrained)
    data = arithmetic_sequences(64, args.seq_len, config.vocab_size, seed=0)
    module = FineTune(pretrained, args.lr)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=args.batch_size))

    probe = arithmetic_sequences(2, args.seq_len, config.vocab_size, seed=1).to(module.device)
    with torch.no_grad():
        trained = module.model(input_ids=probe).logits  # every rank: gathered logits
    modelpar.hf.save_pretrained(module.model, args.out)  # collective; rank 0 writes
    if trainer.is_global_zero:
        print(f"finished at step {trainer.global_step}; exported to {args.out}")
        back = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(module.device)
        with torch.no_grad():
            diff = (back(input_ids=probe).logits - trained).abs().max().item()
        same = diff < 1e-4  # tensor parallelism sums in another order than one process
        print(f"from_pretrained(out) reproduces the trained model's logits: {same} (max diff {diff:.2e})")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
