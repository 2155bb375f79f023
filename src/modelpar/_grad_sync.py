"""Skipping gradient reduction during accumulation, with FSDP2's ``set_requires_gradient_sync``.

FSDP2 has no public getter for the sync flag, so this control keeps its own record of what it set on
each FSDP module. Entering records the current flag and turns sync off; exiting restores exactly what
was recorded. Nested contexts therefore compose, and ``enabled=False`` changes nothing at all.
(Lightning 2.6.6 sets sync to ``enabled`` on exit, which leaves it off after an ``enabled=False`` block.)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["GradientSyncControl"]


class GradientSyncControl:
    """Per-strategy record of the gradient-sync flag of every FSDP module it has touched."""

    def __init__(self) -> None:
        self._flags: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def requires_sync(self, module: nn.Module) -> bool:
        """The flag as this control last set it; FSDP's default (``True``) for modules it never touched."""
        return self._flags.get(module, True)

    def _set(self, module: nn.Module, value: bool) -> None:
        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(value, recurse=False)
        self._flags[module] = value

    @contextmanager
    def no_sync(self, module: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Within the block, backward passes accumulate unreduced gradients (when ``enabled``)."""
        if not enabled:
            yield
            return
        fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        previous = [(m, self.requires_sync(m)) for m in fsdp_modules]
        for m in fsdp_modules:
            self._set(m, False)
        try:
            yield
        finally:
            for m, flag in previous:
                self._set(m, flag)
