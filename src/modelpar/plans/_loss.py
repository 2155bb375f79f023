"""Loss parallelism in the training step: cross-entropy on vocab-sharded logits, without gathering them.

With ``ParallelPlan(loss_parallel=True)`` the LM head returns its logits as a DTensor sharded over the
vocabulary on the tensor-parallel ranks; each rank holds ``vocab / tp`` columns. torch computes
cross-entropy on them directly (a max and a sum all-reduced over the tensor-parallel ranks, never the full
logits) inside its ``loss_parallel()`` context, which must also cover ``backward``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

__all__ = ["loss_parallel"]


@contextmanager
def loss_parallel(logits: torch.Tensor) -> Iterator[None]:
    """Compute the loss of ``logits``, and run backward, inside this block: works whether or not they are sharded.

    A no-op for plain tensors (no tensor parallelism, or a plan without loss parallelism); torch's
    ``torch.distributed.tensor.parallel.loss_parallel()`` for DTensor logits. So one training step serves
    every layout::

        logits = model(inputs)
        with modelpar.plans.loss_parallel(logits):
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            fabric.backward(loss)
        # under loss parallelism `loss` is a replicated DTensor: `loss.full_tensor()` (or `.item()`) to log it

    Inside, only ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` (class indices as targets, a plain tensor)
    work on sharded logits; reshapes that keep the vocabulary last (``flatten(0, 1)``, ``.float()``) are fine.
    """
    if isinstance(logits, DTensor):
        with _torch_loss_parallel():
            yield
    else:
        yield
