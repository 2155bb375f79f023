"""Checkpoint formats: distributed (DCP folder, reshardable) and full (one file), chosen per save.

Saves are atomic (a checkpoint appears at its path only when complete) and optionally asynchronous;
full files load into sharded models tensor by tensor. The strategies hold a :class:`Checkpointer`;
:func:`save_state` / :func:`load_state` serve standalone scripts.
"""

from modelpar.checkpoint._api import load_state, save_state
from modelpar.checkpoint._checkpointer import Checkpointer
from modelpar.checkpoint._format import CheckpointFormat
from modelpar.checkpoint._io import detect as detect_format

__all__ = ["CheckpointFormat", "Checkpointer", "detect_format", "load_state", "save_state"]
