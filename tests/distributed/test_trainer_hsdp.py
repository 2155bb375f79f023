"""The Trainer strategy on HSDP: accumulation in both modes, and checkpoints that move between HSDP and 2-D.

One spawn of 4 processes as two nodes (a replica per node, sharded within it), in the standalone
``pytorch_lightning`` namespace (``test_trainer.py`` runs both namespaces on 2-D meshes):

* ``Trainer.fit`` on HSDP 2x2x1 with ``accumulate_grad_batches=2``, for ``gradient_accumulation="sharded"``
  and ``"unsharded"``: the weights after two optimizer steps equal the single-process reference that
  accumulates the same micro-batches (tolerance: another reduction order), and the collectives counted in
  each backward show that each mode defers what it promises (``"sharded"``: reduce-scatter on every
  micro-batch, the all-reduce across replicas only on the last; ``"unsharded"``: no reduction before the last);
* HSDP 2x2x1 saves through ``ModelCheckpoint`` (folders); a 2-D 2x2 Trainer resumes from its first epoch
  like the reference and saves single files; HSDP 2x1x2 resumes from one of those like the reference. Each
  run's last checkpoint, evaluated on the other kind of mesh (``validate(ckpt_path=...)``), holds exactly the
  weights that run ended with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning import Callback
from test_trainer import assert_weights, full_weights
from torch.distributed.tensor.debug import CommDebugMode

from harness import PG_TIMEOUT, run_distributed
from modelpar.trainer import ModelParallelStrategy
from trainer_module import GLOBAL_BATCH, lightning, loader, quiet_trainer, reference_run

#: name -> (data_parallel_size, tensor_parallel_size, data_parallel_replicate_size)
LAYOUTS = {"2x2x1": (4, 1, 2), "2x1x2": (2, 2, 2), "2x2": (2, 2, 1)}


def trainer(layout: str, **kwargs: Any) -> Any:
    dp, tp, replicate = LAYOUTS[layout]
    strategy_kwargs = {
        k: kwargs.pop(k) for k in ("save_distributed_checkpoint", "gradient_accumulation") if k in kwargs
    }
    strategy = ModelParallelStrategy(
        dp, tp, timeout=PG_TIMEOUT, data_parallel_replicate_size=replicate, **strategy_kwargs
    )
    defaults = {"accelerator": "cpu", "devices": 2, "num_nodes": 2, "strategy": strategy, "enable_checkpointing": False}
    return quiet_trainer(**{**defaults, **kwargs})


def per_rank(layout: str) -> int:
    return GLOBAL_BATCH // LAYOUTS[layout][0]


class CountCollectives(Callback):
    """The collectives each backward runs, micro-batch by micro-batch (Lightning's hooks around the backward)."""

    def __init__(self) -> None:
        self.counts: list[dict[str, int]] = []
        self._counter: CommDebugMode | None = None

    def on_before_backward(self, *args: Any) -> None:
        self._counter = CommDebugMode()
        self._counter.__enter__()

    def on_after_backward(self, *args: Any) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.counts.append({str(k): v for k, v in self._counter.get_comm_counts().items()})


def case_accumulation(mode: str) -> dict[str, Any]:
    counter = CountCollectives()
    t = trainer("2x2x1", max_steps=2, accumulate_grad_batches=2, gradient_accumulation=mode, callbacks=[counter])
    module = lightning().LlamaModule()
    t.fit(module, loader(per_rank("2x2x1"), micro_batches=2))
    assert t.global_step == 2
    mesh = t.strategy.device_mesh
    assert tuple(mesh.shape) == (2, 2, 1), mesh
    assert_weights(module, reference_run(2, accumulate=2)[0], f"HSDP accumulate ({mode})")
    return {"comms": counter.counts}


def case_checkpoints_move_between_hsdp_and_2d(root: Path) -> dict[str, Any]:
    """HSDP 2x2x1 saves (folders) -> 2x2 resumes and saves (files) -> HSDP 2x1x2 resumes; exact weights checks."""
    ModelCheckpoint, LlamaModule = lightning().ModelCheckpoint, lightning().LlamaModule
    from_hsdp, from_2d = root / "from-hsdp", root / "from-2d"
    reference = reference_run(3)[0]
    t = trainer(
        "2x2x1",
        max_epochs=3,
        enable_checkpointing=True,
        save_distributed_checkpoint=True,
        callbacks=[ModelCheckpoint(dirpath=from_hsdp, save_top_k=-1, save_last=True)],
    )
    module = LlamaModule()
    t.fit(module, loader(per_rank("2x2x1")))
    final = full_weights(module)
    assert_weights(module, reference, "HSDP fit with checkpoints")
    # resume from the end of epoch 0 on 2x2: model, optimizer, scheduler and loops; it saves single files
    t2 = trainer(
        "2x2",
        max_epochs=3,
        enable_checkpointing=True,
        save_distributed_checkpoint=False,
        callbacks=[ModelCheckpoint(dirpath=from_2d, save_top_k=-1, save_last=True)],
    )
    module2 = LlamaModule()
    t2.fit(module2, loader(per_rank("2x2")), ckpt_path=from_hsdp / "epoch=0-step=1.ckpt")
    assert t2.global_step == 3
    assert_weights(module2, reference, "HSDP checkpoint -> 2x2 resume")
    torch.testing.assert_close(full_weights(module2), final, atol=2e-5, rtol=1e-4)
    final2 = full_weights(module2)
    # and back: the 2x2 run's checkpoint of epoch 1 resumes on HSDP 2x1x2
    t3 = trainer("2x1x2", max_epochs=3)
    module3 = LlamaModule()
    t3.fit(module3, loader(per_rank("2x1x2")), ckpt_path=from_2d / "epoch=1-step=2.ckpt")
    assert t3.global_step == 3 and tuple(t3.strategy.device_mesh.shape) == (2, 1, 2)
    assert_weights(module3, reference, "2x2 checkpoint -> HSDP 2x1x2 resume")
    # the last checkpoints hold exactly the weights their runs ended with, on the other kind of mesh
    exact = {}
    for ckpt, layout, want in ((from_hsdp, "2x2", final), (from_2d, "2x2x1", final2)):
        module4 = LlamaModule()
        trainer(layout).validate(module4, loader(per_rank(layout)), ckpt_path=ckpt / "last.ckpt", verbose=False)
        torch.testing.assert_close(full_weights(module4), want, atol=0, rtol=0)
        exact[f"{ckpt.name}->{layout}"] = True
    kinds = {p.name: ("dir" if (p / "last.ckpt").is_dir() else "file") for p in (from_hsdp, from_2d)}
    return {
        "files": {p.name: sorted(f.name for f in p.iterdir()) for p in (from_hsdp, from_2d)},
        "kinds": kinds,
        "exact": exact,
    }


def grid(root: Path) -> dict[str, Any]:
    return {
        **{f"accumulate_{mode}": case_accumulation(mode) for mode in ("sharded", "unsharded")},
        "checkpoints": case_checkpoints_move_between_hsdp_and_2d(root),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(grid, 4, tmp_path_factory.mktemp("trainer-hsdp"), nodes=2, timeout=180)


@pytest.mark.parametrize("mode", ["sharded", "unsharded"])
def test_accumulation_on_hsdp_matches_the_reference_and_defers_what_the_mode_says(results, mode):
    """The weights are checked in the case; here, which reductions ran on each of the four micro-batches."""
    for r in results:
        comms = r[f"accumulate_{mode}"]["comms"]
        assert len(comms) == 4, comms  # two steps of two micro-batches
        for first, last in (comms[0:2], comms[2:4]):
            assert any("reduce_scatter" in k for k in last) and last.get("c10d.allreduce_", 0) > 0, last
            if mode == "sharded":  # reduce-scatter within the replica; the all-reduce across replicas waits
                assert any("reduce_scatter" in k for k in first) and first.get("c10d.allreduce_", 0) == 0, first
            else:  # nothing reduced before the last micro-batch
                assert not any("reduce" in k for k in first), first


def test_a_hsdp_trainer_checkpoint_resumes_on_a_2d_layout_and_back_with_the_same_weights(results):
    for r in results:
        c = r["checkpoints"]
        assert {"epoch=0-step=1.ckpt", "epoch=2-step=3.ckpt", "last.ckpt"} <= set(c["files"]["from-hsdp"])
        assert {"epoch=1-step=2.ckpt", "epoch=2-step=3.ckpt", "last.ckpt"} <= set(c["files"]["from-2d"])
        assert c["kinds"] == {"from-hsdp": "dir", "from-2d": "file"}
        assert c["exact"] == {"from-hsdp->2x2": True, "from-2d->2x2x1": True}
