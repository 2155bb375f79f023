"""Checkpoint formats: distributed (DCP folder, reshardable) and full (one file), chosen per save.

The strategies call :func:`save_state` / :func:`load_state`; they are public for standalone use too.
"""

from modelpar.checkpoint._api import load_state, save_state
from modelpar.checkpoint._format import CheckpointFormat, detect_format
from modelpar.checkpoint._io import load_module_full_state

__all__ = ["CheckpointFormat", "detect_format", "load_module_full_state", "load_state", "save_state"]
