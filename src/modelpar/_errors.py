"""The exception types modelpar raises where Lightning or torch already raise a type of their own.

modelpar replaces Lightning's ``ModelParallelStrategy`` and wraps torch's loading functions, so code written
against them has ``except`` clauses for the types *they* raise. Each class here derives from that type and
from the precise built-in type our message calls for (as numpy's ``AxisError`` derives from ``ValueError``
and ``IndexError``), so both the old ``except`` clauses and the natural ones catch it. Situations where
Lightning and torch agree with our choice (``TypeError`` for a bad ``parallelize_fn``, ``IsADirectoryError``
for a folder in the way ...) raise the built-in type itself.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "MeshSizeError",
    "PipelineSplitError",
    "ShardingStrategyError",
    "UnsupportedReduceOpError",
    "UnsupportedStyleError",
    "WeightsOnlyError",
]


class MeshSizeError(ValueError, RuntimeError):
    """Mesh sizes that cannot make a ``data_parallel x tensor_parallel`` mesh of the world size.

    ``ValueError``: the sizes are bad argument values. ``RuntimeError``: what Lightning's strategies raise
    when ``data_parallel_size * tensor_parallel_size`` is not the world size (``_setup_device_mesh``).
    """


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """Nothing exists at the checkpoint path.

    ``FileNotFoundError``: what ``torch.load`` and Lightning's other strategies (``TorchCheckpointIO``) raise.
    ``ValueError``: what Lightning's ``ModelParallelStrategy`` raises for a path that is neither a checkpoint
    folder nor a file (``_load_checkpoint``, ``_load_raw_module_state_from_path``).
    """


class CheckpointKeyError(KeyError, RuntimeError):
    """A strict load where the checkpoint and the requested state disagree on keys (missing or unexpected).

    ``KeyError``: what Lightning raises for a requested key the checkpoint lacks (``_validate_keys_for_strict_
    loading``, ``_load_raw_module_state``, ``checkpoint.pop(key)``). ``RuntimeError``: what torch's
    ``nn.Module.load_state_dict`` and ``set_model_state_dict`` raise for missing or unexpected keys.
    """

    def __str__(self) -> str:
        # KeyError shows its argument as a repr (in quotes, escaped); ours is a message, shown as is.
        return BaseException.__str__(self)


class CheckpointShapeError(ValueError, RuntimeError):
    """A saved tensor whose shape differs from the model's.

    ``ValueError``: what torch.distributed.checkpoint's load planner raises for a size mismatch.
    ``RuntimeError``: what ``nn.Module.load_state_dict`` and ``set_model_state_dict`` raise.
    """


class CorruptCheckpointError(ValueError, RuntimeError):
    """A checkpoint file that cannot be read: truncated, damaged, or not a checkpoint at all.

    ``ValueError``: the file's contents are bad. ``RuntimeError``: what ``torch.load(..., mmap=True)`` raises
    for such files (Lightning's strategies pass it through).
    """


class WeightsOnlyError(ValueError, pickle.UnpicklingError):
    """A checkpoint holding objects that ``torch.load(..., weights_only=True)`` refuses to unpickle.

    ``pickle.UnpicklingError``: what ``torch.load`` raises (Lightning passes it through). ``ValueError``:
    the type modelpar's other load errors share.
    """


class UnsupportedReduceOpError(ValueError, AttributeError):
    """A ``reduce_op`` name that is not a reduction.

    ``ValueError``: a bad argument value. ``AttributeError``: what Lightning's strategies raise for it
    (``getattr(ReduceOp, name.upper())`` in ``_sync_ddp``).
    """


class UnsupportedStyleError(TypeError, NotImplementedError):
    """A tensor-parallel style given a module of a kind it cannot shard (``"colwise"`` on a norm, say).

    ``TypeError``: the module has the wrong type for the style. ``NotImplementedError``: what torch's
    ``ColwiseParallel`` and ``RowwiseParallel`` raise for a module other than ``nn.Linear`` or ``nn.Embedding``.
    """


class ShardingStrategyError(ValueError, KeyError):
    """A ``sharding_strategy`` name that is not one of FSDP1's.

    ``ValueError``: a bad argument value. ``KeyError``: what Lightning's ``FSDPStrategy`` raises for it
    (``ShardingStrategy[name.upper()]`` in ``_init_sharding_strategy``).
    """

    def __str__(self) -> str:
        return BaseException.__str__(self)  # a message, not a key: shown as is


class PipelineSplitError(ValueError):
    """A model that cannot be cut into the pipeline stages asked for: more stages than blocks, no run of repeated
    blocks, a ``pipeline_split`` that misses or repeats modules, weights tied across stages.

    ``ValueError``: torch's ``torch.distributed.pipelining`` raises it for a split it cannot make.
    """
