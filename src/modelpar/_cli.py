"""The ``modelpar`` command line: ``convert`` between checkpoint formats (or to Hugging Face's) and ``inspect`` one.
``estimate`` prints the per-rank memory of a model on a layout, computed without running it.

The only place in the package that prints. Library errors become ``error: <message>`` and exit code 2,
without a traceback: the messages already say what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from modelpar._errors import CheckpointKeyError

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: The estimate's line in ``modelpar -h``.
_ESTIMATE_HELP = (
    "per-rank memory of a model on a layout (state, activations, FSDP2 transients, peak); --search: which fit"
)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``command``: the subcommand given, if known.

    The ``estimate`` subcommand's choices come from the plans, float8 and pipeline packages, whose imports
    (``torch.distributed.tensor``, ``torch._dynamo``) took 1.8 s of the 4.1 s a ``convert`` or ``inspect`` spent
    starting (2026-11-27): its arguments are built only when it is the command, or none is known yet.
    """
    parser = argparse.ArgumentParser(prog="modelpar", description="Offline tools for modelpar checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    convert = commands.add_parser(
        "convert",
        help="convert a distributed checkpoint folder into one file, or back",
        description="Convert between a distributed checkpoint folder and a full (single-file) checkpoint, in one"
        " process with memory near the largest tensor.",
    )
    convert.add_argument("src", metavar="SRC", help="checkpoint folder or file to read (a path, or a URL: s3://...)")
    convert.add_argument("dst", metavar="DST", help="where to write the converted checkpoint (a path or a URL)")
    convert.add_argument(
        "--to",
        choices=["file", "distributed", "hf"],
        help="target format (default: a folder converts to a file, a file to a folder); hf: a Hugging Face"
        " pretrained folder from a distributed checkpoint folder (needs --config and the hf extra)",
    )
    convert.add_argument("--model-only", action="store_true", help="keep model weights only (--to file)")
    convert.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="cast the model weights (--to file, --to hf); optimizer state and other entries keep their saved dtypes",
    )
    convert.add_argument(
        "--config", type=Path, metavar="CONFIG_DIR", help="the Hugging Face model's folder with config.json (--to hf)"
    )
    convert.add_argument(
        "--key", default="model", help="the checkpoint entry holding the model (--to hf; default: model)"
    )
    convert.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB (--to hf; default: 5GB)"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    convert.add_argument(
        "--trust",
        action="store_true",
        help="unpickle any object the checkpoint holds (weights_only=False); only for checkpoints you trust",
    )
    convert.set_defaults(subparser=convert)
    inspect = commands.add_parser("inspect", help="list a checkpoint's tensors, sizes and metadata")
    inspect.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    inspect.add_argument(
        "--trust",
        action="store_true",
        help="unpickle any object the checkpoint holds (weights_only=False); only for checkpoints you trust",
    )
    if command in (None, "estimate"):
        _estimate_parser(commands)
    else:
        commands.add_parser("estimate", help=_ESTIMATE_HELP)
    return parser


def _estimate_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from modelpar._strategy.precision import SUPPORTED_PRECISIONS
    from modelpar.float8 import RECIPES
    from modelpar.memory._estimate import OPTIMIZER_STATES
    from modelpar.pipeline import OFFERED_SCHEDULES

    estimate = commands.add_parser(
        "estimate",
        help=_ESTIMATE_HELP,
        description="Estimate the memory per rank of a model under a parallel plan, from its config alone (the model"
        " is built on the meta device; no process group): parameters, gradients, optimizer states, FSDP2's"
        " transient buffers and, with --seq-len, activations, adding up to the peak. --search lists the layouts"
        " of --world-size ranks whose peak fits --gpu-memory, best first: least recomputation (AC none, then"
        " selective, then full: recomputation costs compute every step), then the smallest tensor-parallel size,"
        " then the smallest context-parallel size (both add collectives inside every layer), then the fewest"
        " replicas, then the smallest peak; for a MoE with a plan that splits experts, every expert-parallel size"
        " that divides the ranks sharding each replica and the experts (not with context parallelism); every"
        " pipeline-parallel size dividing --world-size that the model's blocks and --micro-batch allow (ranked after"
        " the context-parallel size: its bubble idles part of every step). Not"
        " modelled: allocator slack, NCCL buffers, the CUDA context, MoE routing imbalance (see docs/memory.md);"
        " leave a few GiB of headroom.",
    )
    model = estimate.add_mutually_exclusive_group(required=True)
    model.add_argument("--llama", metavar="JSON", help="modelpar.models.LlamaConfig fields, e.g. '{\"dim\": 4096}'")
    model.add_argument(
        "--hf-config", "--hf", type=Path, metavar="PATH", help="a Hugging Face model folder or its config.json"
    )
    estimate.add_argument("--dp", type=int, default=1, help="data_parallel_size (default: 1)")
    estimate.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (default: 1)")
    estimate.add_argument("--replicate", type=int, default=1, help="data_parallel_replicate_size (default: 1)")
    estimate.add_argument("--cp", type=int, default=1, help="context-parallel size (default: 1)")
    estimate.add_argument(
        "--ep", type=int, default=1, help="expert_parallel_size, for modelpar's MoE Llama (--llama with n_experts)"
    )
    estimate.add_argument(
        "--pipeline-parallel",
        "--pp",
        type=int,
        default=1,
        metavar="N",
        help="pipeline_parallel_size: the worst pipeline rank's stages (default: 1); --micro-batch is then the batch"
        " each data-parallel rank splits into micro-batches",
    )
    estimate.add_argument(
        "--pipeline-schedule", choices=OFFERED_SCHEDULES, default="1F1B", help="pipeline_schedule (default: 1F1B)"
    )
    estimate.add_argument(
        "--pipeline-microbatches",
        type=int,
        metavar="M",
        help="pipeline_microbatches (default: the number of stages)",
    )
    estimate.add_argument(
        "--pipeline-stages-per-rank",
        type=int,
        metavar="V",
        help="pipeline_stages_per_rank, for the looped schedules (default: 2)",
    )
    estimate.add_argument("--optimizer", choices=list(OPTIMIZER_STATES), default="adamw", help="default: adamw")
    estimate.add_argument("--precision", choices=SUPPORTED_PRECISIONS, default="32-true", help="default: 32-true")
    estimate.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of the sharded state")
    estimate.add_argument(
        "--accumulation", choices=["sharded", "unsharded"], default="sharded", help="default: sharded"
    )
    estimate.add_argument("--seq-len", type=int, help="tokens per sample: adds activations (default: state only)")
    estimate.add_argument("--micro-batch", type=int, default=1, help="samples per rank per step (default: 1)")
    estimate.add_argument(
        "--ac", choices=["none", "selective", "full"], default="none", help="activation checkpointing"
    )
    estimate.add_argument("--ac-every", type=int, default=1, help="checkpoint every k-th layer (default: 1)")
    estimate.add_argument(
        "--compile", action="store_true", help="the plan's compile: decoder layers' activations as inductor keeps them"
    )
    estimate.add_argument(
        "--accumulate-grad-batches",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step: from 2 on, gradients are held beside the activations (default: 1)",
    )
    estimate.add_argument(
        "--float8",
        choices=list(RECIPES),
        metavar="RECIPE",
        help=f"the plan's float8 ({', '.join(RECIPES)}): the linear layers modelpar.float8 converts, their weights"
        " all-gathered in float8 (tensorwise, where FSDP2 shards over more than one rank), compiled layers' smaller"
        " activations, the casts of a layer's backward",
    )
    estimate.add_argument("--sequence-parallel", action="store_true", help="the plan's sequence_parallel")
    estimate.add_argument("--loss-parallel", action="store_true", help="the plan's loss_parallel")
    estimate.add_argument("--search", action="store_true", help="list the layouts that fit (needs the next two)")
    estimate.add_argument("--world-size", type=int, help="number of GPUs (--search)")
    estimate.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 80GiB, 80GB, 81920MiB (--search)")
    estimate.set_defaults(subparser=estimate)


def _estimate(args: argparse.Namespace) -> None:
    from modelpar.memory._estimate import estimate_memory, hf_on_meta, llama_on_meta
    from modelpar.memory._search import format_fits, parse_memory, search_layouts

    if args.search and (args.world_size is None or args.gpu_memory is None or args.seq_len is None):
        args.subparser.error("--search needs --world-size, --gpu-memory and --seq-len")
    if args.search and args.ep != 1:
        args.subparser.error("--ep applies without --search (--search tries every expert-parallel size that fits)")
    if args.search and args.pipeline_parallel != 1:
        args.subparser.error(
            "--pipeline-parallel applies without --search (--search tries every pipeline size that fits; set its"
            " schedule and micro-batches with --pipeline-schedule and --pipeline-microbatches)"
        )
    if not args.search and (args.world_size is not None or args.gpu_memory is not None):
        args.subparser.error("--world-size and --gpu-memory apply to --search only")
    model, plan = llama_on_meta(args.llama) if args.llama is not None else hf_on_meta(args.hf_config)
    options = {"sequence_parallel": args.sequence_parallel, "loss_parallel": args.loss_parallel}
    if args.llama is None:
        from modelpar.hf._plan import plan_for

        plan = plan_for(model, **options)  # refuses what Hugging Face models cannot do, with the reason
    plan = plan.replace(**options, activation_checkpointing=args.ac, ac_every=args.ac_every)
    if args.compile:
        plan = plan.replace(compile=True)
    if args.float8 is not None:
        plan = plan.replace(float8=args.float8)
    common = {
        "optimizer": args.optimizer,
        "precision": args.precision,
        "cpu_offload": args.cpu_offload,
        "gradient_accumulation": args.accumulation,
        "accumulate_grad_batches": args.accumulate_grad_batches,
        "pipeline_schedule": args.pipeline_schedule,
        "pipeline_microbatches": args.pipeline_microbatches,
        "pipeline_stages_per_rank": args.pipeline_stages_per_rank,
    }
    if args.search:
        memory = parse_memory(args.gpu_memory)
        fits, tried = search_layouts(
            model,
            plan,
            world_size=args.world_size,
            gpu_memory=memory,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch,
            **common,
        )
        print(format_fits(fits, tried, world_size=args.world_size, gpu_memory=memory))
        return
    print(
        estimate_memory(
            model,
            plan=plan,
            data_parallel_size=args.dp,
            tensor_parallel_size=args.tp,
            data_parallel_replicate_size=args.replicate,
            context_parallel_size=args.cp,
            expert_parallel_size=args.ep,
            pipeline_parallel_size=args.pipeline_parallel,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch,
            **common,
        )
    )


def _convert(args: argparse.Namespace) -> None:
    from modelpar.checkpoint._convert import convert_to_distributed, convert_to_file
    from modelpar.checkpoint._format import CheckpointFormat
    from modelpar.checkpoint._io import detect
    from modelpar.checkpoint._remote import to_location

    target = args.to or ("file" if detect(to_location(args.src)) is CheckpointFormat.DISTRIBUTED else "distributed")
    if (target == "hf") != (args.config is not None):
        args.subparser.error("--to hf needs --config CONFIG_DIR, which applies to --to hf only")
    if target != "hf" and (args.key != "model" or args.max_shard_size != "5GB"):
        args.subparser.error("--key and --max-shard-size apply to --to hf only")
    if target == "hf":
        if args.model_only:
            args.subparser.error("--model-only applies to --to file only (--to hf writes the model weights only)")
        from modelpar.hf import export_checkpoint

        export_checkpoint(
            args.src,
            args.dst,
            config=args.config,
            key=args.key,
            max_shard_size=int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size,
            dtype=_DTYPES[args.dtype] if args.dtype else None,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            weights_only=not args.trust,
        )
        return
    if target == "distributed":
        if args.model_only or args.dtype:
            args.subparser.error("--model-only and --dtype apply when converting to a file (--to file) only")
        convert_to_distributed(
            args.src, args.dst, overwrite=args.overwrite, progress=not args.no_progress, weights_only=not args.trust
        )
        return
    convert_to_file(
        args.src,
        args.dst,
        model_only=args.model_only,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        weights_only=not args.trust,
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``modelpar`` with ``argv`` (default: the process arguments); return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(next((arg for arg in argv if not arg.startswith("-")), None))  # options come after it
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            _convert(args)
        elif args.command == "estimate":
            _estimate(args)
        else:
            from modelpar.checkpoint._inspect import describe_checkpoint

            print(describe_checkpoint(args.path, weights_only=not args.trust))
    except BrokenPipeError:  # `modelpar inspect big | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as the Python docs advise
        return 1
    except (OSError, ValueError, TypeError, ImportError, NotImplementedError, CheckpointKeyError) as err:
        # NotImplementedError: what modelpar refuses for a model it cannot shard that way (`plan_for`'s sequence
        # parallelism, a family without context parallelism), said as an error line like any bad argument.
        from modelpar._errors import WeightsOnlyError

        hint = " On the command line, `--trust` is `weights_only=False`." if isinstance(err, WeightsOnlyError) else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    return 0
