"""Loading Hugging Face pretrained weights into a sharded model: modelpar vs torch's two full-state paths.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_hf_load.py [--hidden 1024 --layers 4 --vocab 32000]

A random Llama-style model is saved once as one safetensors file, then built on the meta device, sharded at
2x2 with ``modelpar.hf.plan_for`` and loaded three ways, each into a freshly set-up model:

* ``modelpar.hf.load_pretrained``: each rank reads only its block of each tensor from the memory map;
* torch, every rank: ``safetensors.torch.load_file`` then ``set_model_state_dict(full_state_dict=True)``
  (what a Lightning user does today: ``fabric.load_raw`` also needs the full state on every rank);
* torch, rank 0: rank 0 loads the file, ``broadcast_from_rank0=True`` sends every tensor to the others.

Reported per method, on the worst rank: seconds, and the peak of anonymous resident memory added during the
load (sampled every millisecond, as in ``bench_checkpoint.py``; file pages of the memory map are page cache,
shared and reclaimable, and not counted). Every method must give the same local shards; rank 0 prints a
markdown table with ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_checkpoint  # its memory sampler (benchmarks/ is on the path when run as a script)
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from modelpar import ModelParallelStrategy


def measure(load: Callable[[], None]) -> tuple[float, float]:
    """(seconds, peak added anonymous bytes), the worst over all ranks, from a trimmed heap."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # so that memory freed by the previous method does not hide a peak
    seconds, added = bench_checkpoint.measure(load)
    return seconds, float(added)


def save_random_model(folder: Path, config: Any) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.02 for k, v in meta.state_dict().items() if "rotary" not in k}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/modelpar-bench-hf-load"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig

    import modelpar.hf

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        plan = modelpar.hf.plan_for(AutoModelForCausalLM.from_config(config))
    strategy = ModelParallelStrategy(plan, data_parallel_size=2, tensor_parallel_size=2)
    strategy.setup_environment()
    rank = dist.get_rank()
    if rank == 0 and not (args.folder / "model.safetensors").exists():
        save_random_model(args.folder, config)
    dist.barrier()
    file = args.folder / "model.safetensors"

    def fresh() -> Any:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return strategy.setup_module(model)

    def every_rank(model: Any) -> None:
        from safetensors.torch import load_file

        state = load_file(file)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def rank_zero(model: Any) -> None:
        from safetensors.torch import load_file

        state = load_file(file) if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, state, options=options)

    methods: dict[str, Callable[[Any], None]] = {
        "modelpar `load_pretrained`": lambda model: modelpar.hf.load_pretrained(model, args.folder),
        "torch, full state on every rank": every_rank,
        "torch, rank 0 loads and broadcasts": rank_zero,
    }
    results: dict[str, tuple[float, float]] = {}
    shards: dict[str, list[torch.Tensor]] = {}
    for name, load in methods.items():
        model = fresh()
        results[name] = measure(lambda load=load, model=model: load(model))
        shards[name] = [p.to_local().detach().clone() for p in model.parameters()]
        del model
    first = next(iter(shards.values()))
    for name, got in shards.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True)), f"{name} loaded other weights"
    if rank == 0:
        mib = file.stat().st_size / 2**20
        print(f"file: {mib:.0f} MiB fp32, {sum(1 for _ in first)} parameters per rank; mesh 2x2, 4 ranks")
        print("| method | seconds | ratio | peak added anon MiB | ratio |")
        print("| --- | --- | --- | --- | --- |")
        ours_s, ours_b = results["modelpar `load_pretrained`"]
        for name, (seconds, added) in results.items():
            ratio = f"{ours_b / added:.3f}" if added > 2**20 else "-"  # below 1 MiB is sampling noise
            print(f"| {name} | {seconds:.3f} | {ours_s / seconds:.2f} | {added / 2**20:.1f} | {ratio} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
