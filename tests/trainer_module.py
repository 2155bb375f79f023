"""A LightningModule around the tiny Llama, and the plain-PyTorch reference the Trainer runs must match.

The module parallelizes itself in ``configure_model`` when the strategy gives it a mesh, so the very same
class also runs on a single device or under DDP (for checkpoint interchange tests).

Every Trainer test runs under both Lightning namespaces (``pytorch_lightning`` and ``lightning.pytorch``), whose
classes are distinct: a ``lightning.pytorch.Trainer`` wants a ``lightning.pytorch.LightningModule`` and
callbacks. So the test classes are written once as bodies and combined with the base classes of the namespace
chosen by :func:`use_namespace`; :func:`lightning` returns that namespace's classes.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from modelpar.plans import parallelize_llama
from parity import CFG, GLOBAL_BATCH, adamw, global_batches, lm_loss, reference_model

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


TRAINER_NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
_namespace = TRAINER_NAMESPACES[0]


def use_namespace(namespace: str) -> None:
    """Which Lightning namespace :func:`lightning` and :func:`quiet_trainer` use in this process."""
    global _namespace
    if namespace not in TRAINER_NAMESPACES:
        raise ValueError(f"unknown Trainer namespace {namespace!r}")
    _namespace = namespace


@contextmanager
def namespace_of(namespace: str) -> Iterator[None]:
    """:func:`use_namespace` for a block, then the namespace in use before it."""
    before = _namespace
    use_namespace(namespace)
    try:
        yield
    finally:
        use_namespace(before)


class _LlamaBody:
    """The LightningModule's methods; :func:`lightning` puts them on the namespace's ``LightningModule``."""

    device_mesh: Any
    trainer: Any

    def __init__(self, build_in_init: bool = False) -> None:
        super().__init__()  # the namespace's LightningModule
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
        self.log("train_loss", loss, sync_dist=True)  # type: ignore[attr-defined]
        return loss

    def on_after_backward(self) -> None:
        self.grad_none_after_backward.append(all(p.grad is None for p in self.parameters()))  # type: ignore[attr-defined]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", lm_loss(self.model(x), y), sync_dist=True)  # type: ignore[attr-defined]
        dp = self.trainer.strategy.distributed_sampler_kwargs if self.device_mesh is not None else {"rank": 0}
        self.log("dp_rank_plus_one", float(dp["rank"] + 1), sync_dist=True, reduce_fx="sum")  # type: ignore[attr-defined]

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", lm_loss(self.model(x), y), sync_dist=True)  # type: ignore[attr-defined]

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.model(x).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = adamw(self.parameters(), lr=LR)  # type: ignore[attr-defined]
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _SGDBody(_LlamaBody):
    """SGD: AdamW in pure bf16/fp16 turns rounding differences near zero gradients into large updates."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # type: ignore[attr-defined]


class _PlainBody:
    """No configure_model: the strategy has nothing to parallelize it with unless given parallelize_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # type: ignore[attr-defined]


class _CountingBody:
    """Callback state that must survive a resume."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


@cache
def _classes(namespace: str) -> SimpleNamespace:
    pl = importlib.import_module(namespace)
    callbacks = importlib.import_module(f"{namespace}.callbacks")

    def make(name: str, *bases: type) -> type:
        return type(name, bases, {"__module__": __name__, "__qualname__": name})

    llama = make("LlamaModule", _LlamaBody, pl.LightningModule)
    return SimpleNamespace(
        name=namespace,
        pl=pl,
        Trainer=pl.Trainer,
        LightningModule=pl.LightningModule,
        Callback=callbacks.Callback,
        ModelCheckpoint=callbacks.ModelCheckpoint,
        LightningModelParallelStrategy=importlib.import_module(f"{namespace}.strategies").ModelParallelStrategy,
        LlamaModule=llama,
        SGDModule=make("SGDModule", _SGDBody, llama),
        PlainModule=make("PlainModule", _PlainBody, pl.LightningModule),
        CountingCallback=make("CountingCallback", _CountingBody, callbacks.Callback),
    )


def lightning() -> SimpleNamespace:
    """The current namespace's Lightning classes and the test classes built on them."""
    return _classes(_namespace)


@cache
def _scratch_root() -> str:
    """One folder per process for the Trainer's ``default_root_dir``. Forked ranks never run ``atexit``, so it stays
    behind: under pytest it is made in pytest's own tree, which ``TMPDIR`` points at (``tests/conftest.py``)."""
    return tempfile.mkdtemp(prefix="modelpar-trainer-")


def quiet_trainer(**kwargs: Any) -> Any:
    """A Trainer without logger, progress bar, summary or sanity check, writing only to a temporary folder."""
    defaults: dict[str, Any] = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": _scratch_root(),  # never the working tree (ModelCheckpoint's default dirpath)
    }
    return lightning().Trainer(**{**defaults, **kwargs})


def parallelize_lightning_module(module: Any, mesh: Any) -> Any:
    """A `parallelize_fn` for the strategy: shards the LightningModule's model in place, returns the module."""
    parallelize_llama(module.model, mesh)
    return module


def reference_run(
    steps: int, accumulate: int = 1, clip_norm: float | None = None, clip_value: float | None = None
) -> tuple[torch.nn.Module, list[float]]:
    """What the Trainer runs must reproduce: the same steps in plain PyTorch on one process."""
    model = reference_model()
    optimizer = adamw(model.parameters(), lr=LR)
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


#: The standalone namespace's LightningModule, for tests that run one namespace only (the FSDP1 migration).
LlamaModule: Any = _classes(TRAINER_NAMESPACES[0]).LlamaModule

__all__ = [
    "CFG",
    "GLOBAL_BATCH",
    "LlamaModule",
    "TRAINER_NAMESPACES",
    "lightning",
    "loader",
    "parallelize_lightning_module",
    "quiet_trainer",
    "reference_run",
    "use_namespace",
]
