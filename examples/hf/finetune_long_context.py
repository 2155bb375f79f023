"""Fine-tune a Hugging Face Llama on long sequences with context parallelism (each sequence split over ranks).

``context_parallel_size=2`` splits every sequence over two ranks in load-balanced causal chunks; attention
all-gathers keys and values across them (``docs/long-context.md``). On 4 CPU processes by default: 2 data
parallel x 2 context parallel, 2048 tokens per sequence::

    python examples/hf/finetune_long_context.py --make-tiny /tmp/tiny-llama-long
    python examples/hf/finetune_long_context.py --pretrained path/to/llama --seq-len 32768 \\
        --accelerator cuda --devices 8 --context-parallel 4 --precision bf16-true

Each step: the ranks of a context-parallel group get the same samples (the strategy's sampler arguments split
by data-parallel rank only), ``shard_batch`` shifts the labels on the whole sequence and keeps this rank's two
chunks with their global positions, the model runs on the shard, and ``modelpar.context.cross_entropy`` gives
the exact mean over every token of the global batch. Last, rank 0 checks the fine-tuned model on one process:
the sharded loss of a held-out batch must equal the loss of the gathered model on the whole sequence.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from lightning_fabric import Fabric
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import modelpar.hf
from modelpar import ModelParallelStrategy
from modelpar.context import cross_entropy, shard_batch


def make_tiny(folder: Path, seq_len: int) -> None:
    """A tiny random Llama whose rotary tables reach ``seq_len``, saved as a pretrained folder."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(seq_len)).save_pretrained(folder)


def tiny_config(seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=seq_len, tie_word_embeddings=False,
    )  # fmt: skip


def batch_for_step(step: int, batch_size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Arithmetic token sequences, a pure function of the step."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pretrained", type=Path, help="a pretrained folder (config.json + safetensors)")
    source.add_argument("--make-tiny", type=Path, help="write a tiny random Llama here if absent, and use it")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--context-parallel", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (a multiple of 2 x cp)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    pretrained: Path = args.pretrained or args.make_tiny
    config = None if args.make_tiny else AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):  # the plan is data: read it from a model that costs no memory
        plan = modelpar.hf.plan_for(AutoModelForCausalLM.from_config(config or tiny_config(args.seq_len)))
    strategy = ModelParallelStrategy(
        plan,
        data_parallel_size="auto",
        tensor_parallel_size=args.tensor_parallel,
        context_parallel_size=args.context_parallel,
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    if args.make_tiny is not None and fabric.global_rank == 0 and not (pretrained / "config.json").is_file():
        make_tiny(pretrained, args.seq_len)
        print(f"wrote a tiny random Llama to {pretrained}")
    fabric.barrier()
    fabric.seed_everything(42)
    config = AutoConfig.from_pretrained(pretrained)

    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(config)
    model = fabric.setup_module(model)  # FSDP over data x context parallel, attention across the shards
    modelpar.hf.load_pretrained(model, pretrained)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr))
    mesh = strategy.device_mesh
    fabric.print(f"mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))}, {args.seq_len} tokens a row")

    dp = strategy.distributed_sampler_kwargs  # context- and tensor-parallel peers get the same rows
    per_rank = args.batch_size // dp["num_replicas"]
    rows = slice(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank)

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        batch = shard_batch({"input_ids": tokens.to(fabric.device)}, mesh, shift_labels=True)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return cross_entropy(logits, batch["labels"], mesh)  # not the model's loss: it would shift the shard

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = loss_of(batch_for_step(step, args.batch_size, args.seq_len, config.vocab_size)[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step:3d} | loss {fabric.all_reduce(loss.detach()).item():.4f}")
    tokens_per_s = args.steps * args.batch_size * args.seq_len / (time.perf_counter() - start)
    fabric.print(f"{tokens_per_s:.0f} tokens/s over {fabric.world_size} processes")

    held_out = batch_for_step(0, args.batch_size, args.seq_len, config.vocab_size)
    with torch.no_grad():
        sharded = fabric.all_reduce(loss_of(held_out[rows])).item()
    # collective: every rank takes part, rank 0 receives the gathered weights
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fabric.global_rank == 0:
        # a fresh config: the sharded model's was switched to the context-parallel attention
        whole = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained)).to(fabric.device)
        whole.load_state_dict(full_state)  # plain SDPA attention on one process
        with torch.no_grad():
            reference = whole(input_ids=held_out.to(fabric.device), labels=held_out.to(fabric.device)).loss.item()
        same = abs(sharded - reference) < 1e-4 * max(1.0, abs(reference))
        print(f"the sharded loss equals one process's on the whole sequence: {same} ({sharded:.6f} vs {reference:.6f})")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
