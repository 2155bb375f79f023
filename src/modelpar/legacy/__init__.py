"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) compatibility, kept apart from the core.

Detecting FSDP1-wrapped models so they get a migration message instead of a cryptic failure (:mod:`._detect`),
and Lightning ``FSDPStrategy``'s arguments taken by the strategies under their own names, translated into FSDP2
options or refused with the FSDP2 equivalent (:mod:`._arguments`). Checkpoints FSDP1 wrote load through
:mod:`modelpar.checkpoint` like any other.
"""

from modelpar.legacy._arguments import FSDP1_ARGUMENTS, translate_fsdp1_arguments, wrap_policy_selector
from modelpar.legacy._detect import find_fsdp1_modules, reject_fsdp1_modules

__all__ = [
    "FSDP1_ARGUMENTS",
    "find_fsdp1_modules",
    "reject_fsdp1_modules",
    "translate_fsdp1_arguments",
    "wrap_policy_selector",
]
