"""The ``modelpar`` command line: ``convert`` between checkpoint formats and ``inspect`` a checkpoint.

The only place in the package that prints. Library errors become ``error: <message>`` and exit code 2,
without a traceback: the messages already say what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpar", description="Offline tools for modelpar checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    convert = commands.add_parser(
        "convert",
        help="convert a distributed checkpoint folder into one file, or back",
        description="Convert between a distributed checkpoint folder and a full (single-file) checkpoint, in one"
        " process with memory near the largest tensor.",
    )
    convert.add_argument("src", type=Path, metavar="SRC", help="checkpoint folder or file to read")
    convert.add_argument("dst", type=Path, metavar="DST", help="where to write the converted checkpoint")
    convert.add_argument(
        "--to",
        choices=["file", "distributed"],
        help="target format (default: a folder converts to a file, a file to a folder)",
    )
    convert.add_argument("--model-only", action="store_true", help="keep model weights only (--to file)")
    convert.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="cast the model weights (--to file); optimizer state and other entries keep their saved dtypes",
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
    inspect.add_argument("path", type=Path, metavar="PATH", help="checkpoint folder or file")
    inspect.add_argument(
        "--trust",
        action="store_true",
        help="unpickle any object the checkpoint holds (weights_only=False); only for checkpoints you trust",
    )
    return parser


def _convert(args: argparse.Namespace) -> None:
    from modelpar.checkpoint._convert import convert_to_distributed, convert_to_file
    from modelpar.checkpoint._format import CheckpointFormat
    from modelpar.checkpoint._io import detect

    target = args.to or ("file" if detect(args.src) is CheckpointFormat.DISTRIBUTED else "distributed")
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
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            _convert(args)
        else:
            from modelpar.checkpoint._inspect import describe_checkpoint

            print(describe_checkpoint(args.path, weights_only=not args.trust))
    except BrokenPipeError:  # `modelpar inspect big | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as the Python docs advise
        return 1
    except (OSError, ValueError, TypeError) as err:
        from modelpar._errors import WeightsOnlyError

        hint = " On the command line, `--trust` is `weights_only=False`." if isinstance(err, WeightsOnlyError) else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    return 0
