"""A LightningModule around the tiny Llama, and the plain-PyTorch reference the Trainer runs must match.

The module parallelizes itself in ``configure_model`` when the strategy gives it a mesh, so the very same
class also runs on a single device or under DDP (for checkpoint interchange tests).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from modelpar.plans import parallelize_llama
from parity import CFG, GLOBAL_BATCH, global_batches, lm_loss, reference_model

LR = 1e-2
GAMMA = 0.8


def dataset(micro_batches: int = 1) -> TensorDataset:
    xs, ys = zip(*global_batches(micro_batches), strict=True)
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def loader(per_rank_batch: int, micro_batches: int = 1) -> DataLoader:
    """One optimizer step per epoch: each step consumes the whole dataset (``micro_batches`` global batches).

    The Trainer shuffles training data with the sampler it injects (a single-device run does not), so
    which samples meet in a micro-batch differs between runs. With equal-size micro-batches whose losses
    are means, the gradient of a step that sees the whole dataset is the mean over all of it whatever the
    order or split: every layout, the single-device runs and the reference agree exactly.
    """
    return DataLoader(dataset(micro_batches), batch_size=per_rank_batch, shuffle=False)


class LlamaModule(pl.LightningModule):
    def __init__(self, build_in_init: bool = False) -> None:
        super().__init__()
        self.model: Any = reference_model() if build_in_init else None
        self.grad_none_after_backward: list[bool] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = reference_model()
        if self.device_mesh is not None and not hasattr(self.model, "_modelpar_parallel"):
            parallelize_llama(self.model, self.device_mesh)
            self.model._modelpar_parallel = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        self.grad_none_after_backward.append(all(p.grad is None for p in self.parameters()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", lm_loss(self.model(x), y), sync_dist=True)
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.device_mesh is not None else {"rank": 0}
        self.log("dp_rank_plus_one", float(dp["rank"] + 1), sync_dist=True, reduce_fx="sum")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", lm_loss(self.model(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.model(x).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A Trainer without logger, progress bar, summary or sanity check; ``kwargs`` override."""
    defaults: dict[str, Any] = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def parallelize_lightning_module(module: LlamaModule, mesh: Any) -> LlamaModule:
    """A `parallelize_fn` for the strategy: shards the LightningModule's model in place, returns the module."""
    parallelize_llama(module.model, mesh)
    return module


def reference_run(
    steps: int, accumulate: int = 1, clip_norm: float | None = None, clip_value: float | None = None
) -> tuple[torch.nn.Module, list[float]]:
    """What the Trainer runs must reproduce: the same steps in plain PyTorch on one process."""
    model = reference_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    batches = global_batches(accumulate)
    losses = []
    for _ in range(steps):
        for x, y in batches:
            loss = lm_loss(model(x), y)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, losses


__all__ = [
    "CFG",
    "GLOBAL_BATCH",
    "LlamaModule",
    "loader",
    "parallelize_lightning_module",
    "quiet_trainer",
    "reference_run",
]
