"""Fine-tune a Hugging Face Llama (or a mixture of experts) with Fabric at data_parallel=2 x tensor_parallel=2, export it.

No hand-written sharding: ``modelpar.hf.plan_for(model)`` reads the model's own tensor-parallel plan. Runs on
4 CPU processes (gloo) by default::

    python examples/hf/finetune_fabric.py --make-tiny /tmp/tiny-llama --out /tmp/tiny-llama-tuned
    python examples/hf/finetune_fabric.py --pretrained path/to/llama --out exports/llama-tuned --accelerator cuda

A mixture of experts (Qwen3-MoE, Mixtral ...) runs the same way; ``--expert-parallel N`` splits its experts over N
ranks of the data-parallel ones (tokens reach them by all-to-all), and tensor parallelism splits them whole::

    python examples/hf/finetune_fabric.py --make-tiny /tmp/tiny-moe --moe --expert-parallel 2 --out /tmp/tiny-moe-tuned

``--make-tiny DIR`` writes a tiny random Llama (``--moe``: Qwen3-MoE, 4 experts, top-2) to DIR if DIR has no
``config.json`` yet, and fine-tunes it. The
model is built on the meta device, sharded, filled with ``load_pretrained`` (each rank reads only its shards),
trained for ``--steps`` AdamW steps, and written with ``save_pretrained``. Last, rank 0 loads the export with
``from_pretrained`` and reports whether it reproduces the trained model's logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning_fabric import Fabric
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import modelpar.hf
from modelpar import ModelParallelStrategy


def make_tiny(folder: Path, moe: bool) -> None:
    """A tiny random Llama or Qwen3-MoE saved as a pretrained folder (heads and experts divisible by TP and EP)."""
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if moe:
        config = Qwen3MoeConfig(**sizes, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        config = LlamaConfig(**sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def parallelize(model: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
    """The model's own Hugging Face plan, read from the (meta-device) model being set up, applied to it."""
    return modelpar.hf.plan_for(model)(model, device_mesh)


def batch_for_step(step: int, batch_size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Arithmetic token sequences, a pure function of the step (the labels are the inputs: HF shifts them)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pretrained", type=Path, help="a pretrained folder (config.json + safetensors)")
    source.add_argument("--make-tiny", type=Path, help="write a tiny random Llama here if absent, and use it")
    parser.add_argument("--moe", action="store_true", help="--make-tiny writes a tiny Qwen3-MoE instead")
    parser.add_argument("--out", type=Path, required=True, help="where to export the fine-tuned model")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--expert-parallel", type=int, default=1, help="a MoE's experts over this many ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    pretrained: Path = args.pretrained or args.make_tiny
    strategy = ModelParallelStrategy(
        parallelize, args.data_parallel, args.tensor_parallel, expert_parallel_size=args.expert_parallel
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    if args.make_tiny is not None and fabric.global_rank == 0 and not (pretrained / "config.json").is_file():
        make_tiny(pretrained, args.moe)
        print(f"wrote a tiny random {'Qwen3-MoE' if args.moe else 'Llama'} to {pretrained}")
    fabric.barrier()
    fabric.seed_everything(42)  # every rank alike (making the tiny model drew from rank 0's random stream)

    config = AutoConfig.from_pretrained(pretrained)
    with fabric.init_module(empty_init=True):  # meta device: no memory until sharded
        model = AutoModelForCausalLM.from_config(config)
    model = fabric.setup_module(model)  # plan_for's tensor parallelism + FSDP2, then each rank materializes
    modelpar.hf.load_pretrained(model, pretrained)  # every rank reads only its own blocks
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr))

    dp = strategy.distributed_sampler_kwargs  # tensor-parallel peers get the same slice
    per_rank = args.batch_size // dp["num_replicas"]
    rows = slice(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank)
    for step in range(1, args.steps + 1):
        tokens = batch_for_step(step, args.batch_size, args.seq_len, config.vocab_size)[rows].to(fabric.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step:3d} | loss {fabric.all_reduce(loss.detach()).item():.4f}")

    probe = batch_for_step(0, 2, args.seq_len, config.vocab_size).to(fabric.device)
    with torch.no_grad():
        trained = model(input_ids=probe).logits  # gathered logits, the same on every rank
    modelpar.hf.save_pretrained(model, args.out)  # collective; rank 0 writes
    fabric.print(f"exported to {args.out}")
    if fabric.global_rank == 0:
        back = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(fabric.device)
        with torch.no_grad():
            diff = (back(input_ids=probe).logits - trained).abs().max().item()
        same = diff < 1e-4  # tensor parallelism sums in another order than one process
        print(f"from_pretrained(out) reproduces the trained model's logits: {same} (max diff {diff:.2e})")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
