"""Checkpoint formats: distributed (DCP folder, reshardable) and full (one file), chosen per save.

Saves are atomic (a checkpoint appears at its path only when complete) and optionally asynchronous;
full files load into sharded models tensor by tensor. The strategies hold a :class:`Checkpointer`;
:func:`save_state` / :func:`load_state` serve standalone scripts; :func:`convert_to_file`,
:func:`convert_to_distributed` and :func:`describe_checkpoint` work offline (also as ``python -m modelpar``);
:class:`RunCheckpoints` keeps a run folder of periodic checkpoints (retention, resume after a restart, a final
save on a preemption signal).
The errors of loading (:class:`CheckpointNotFoundError`, :class:`CheckpointKeyError` ...) are also here.
"""

from modelpar._errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    CorruptCheckpointError,
    WeightsOnlyError,
)
from modelpar.checkpoint._api import load_state, save_state
from modelpar.checkpoint._checkpointer import Checkpointer
from modelpar.checkpoint._convert import convert_to_distributed, convert_to_file
from modelpar.checkpoint._format import CheckpointFormat
from modelpar.checkpoint._inspect import describe_checkpoint
from modelpar.checkpoint._io import detect as detect_format
from modelpar.checkpoint._names import clean_name
from modelpar.checkpoint._rekey import optimizer_state_to_names, optimizer_state_to_positions
from modelpar.checkpoint._run import RunCheckpoints

__all__ = [
    "CheckpointFormat",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointShapeError",
    "Checkpointer",
    "clean_name",
    "convert_to_distributed",
    "convert_to_file",
    "CorruptCheckpointError",
    "describe_checkpoint",
    "detect_format",
    "load_state",
    "optimizer_state_to_names",
    "optimizer_state_to_positions",
    "RunCheckpoints",
    "save_state",
    "WeightsOnlyError",
]
