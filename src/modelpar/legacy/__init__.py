"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) compatibility, kept apart from the core.

Today: detecting FSDP1-wrapped models so they get a migration message instead of a cryptic failure.
"""

from modelpar.legacy._detect import find_fsdp1_modules, reject_fsdp1_modules

__all__ = ["find_fsdp1_modules", "reject_fsdp1_modules"]
