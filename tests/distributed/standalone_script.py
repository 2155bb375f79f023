"""Run under ``torchrun`` by test_standalone.py: the strategy with no Fabric and no Trainer.

Trains a few AdamW steps with plain torch calls, compares with a single-process reference, clips, saves
and reloads a checkpoint, and writes this rank's findings as JSON to ``<out_dir>/rank<N>.json``. It ends right
after a collective (:func:`_end_right_after_a_collective`), which must not abort the process at exit.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for parity and harness

from harness import PG_TIMEOUT
from modelpar import ModelParallelStrategy
from modelpar.plans import parallelize_llama
from parity import adamw, assert_matches, global_batches, lm_loss, reference_model


def main(out_dir: Path) -> None:
    strategy = ModelParallelStrategy(parallelize_llama, timeout=PG_TIMEOUT)  # everything else detected
    strategy.setup_environment()
    mesh = strategy.device_mesh
    ref = reference_model()
    model = strategy.setup_module(copy.deepcopy(ref))
    optimizer = adamw(model.parameters(), lr=1e-2)
    ref_opt = adamw(ref.parameters(), lr=1e-2)
    kw = strategy.distributed_sampler_kwargs
    losses = []
    for x, y in global_batches(3):
        per = x.shape[0] // kw["num_replicas"]
        sl = slice(kw["rank"] * per, (kw["rank"] + 1) * per)
        loss = lm_loss(model(x[sl]), y[sl])
        loss.backward()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        norm = strategy.clip_gradients_norm(model, optimizer, max_norm=1e9)  # measures, does not clip
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
        assert_matches(model, ref, "grad")
        optimizer.step(), ref_opt.step(), optimizer.zero_grad(), ref_opt.zero_grad()
        assert_matches(model, ref, "param")
        losses.append(strategy.all_reduce(loss.detach().clone()).item())
    ckpt = strategy.broadcast(str(out_dir / "ckpt"))
    strategy.save_checkpoint(ckpt, {"model": model, "optimizer": optimizer, "step": 3})
    fresh = strategy.setup_module(reference_model(seed=1))
    fresh_opt = adamw(fresh.parameters(), lr=1e-2)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    strategy.load_checkpoint(ckpt, state)
    assert_matches(fresh, ref, "param")
    assert state["step"] == 3
    pipeline_err = _pipeline_steps()
    result = {
        "pipeline_err": pipeline_err,
        "rank": dist.get_rank(),
        "mesh": list(mesh.shape),
        "num_nodes": strategy.num_nodes,
        "device": str(strategy.root_device),
        "precision": strategy.precision.precision,
        "losses": losses,
    }
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    strategy.teardown()
    _end_right_after_a_collective()


#: Process groups kept alive past ``destroy_process_group``, as a model's FSDP state or a device mesh keeps them.
_KEPT: list[object] = []


def _end_right_after_a_collective() -> None:
    """Collectives on a group the script keeps, then ``destroy_process_group``, and the script ends.

    Gloo's workers release the last collective's tensors after the script ends; that must not abort it. Left to
    Python's finalization, a worker blocked on the GIL to release them is ended inside a C++ destructor and the
    process aborts ("terminate called without an active exception"; gdb shows ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncWork`` -> ``decref_pyobject`` -> ``pthread_exit``). Measured with 4 processes: 1 launch of 12 aborted
    before modelpar's exit handler paused for the workers, 0 of 16 after (plain torch, with no handler: 15 of 24).
    The two launches of test_standalone.py (6 processes) are a smoke check of that path, not a proof.
    """
    held = dist.new_group()
    _KEPT.extend([dist.group.WORLD, held])
    for _ in range(200):
        t = torch.ones(1000)
        dist.all_reduce(t, group=held)
        t.sum().item()
        del t  # the tensor's Python object is gone before gloo's worker thread lets go of the tensor
    dist.destroy_process_group()  # as a tidy script ends; the groups live on in _KEPT


def _pipeline_steps() -> float:
    """The same strategy class with the model cut in 2 pipeline stages (no parallelize_fn): ``pipeline_step``'s
    losses against the reference's; the data-parallel ranks (the world / 2) each take their slice."""
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_microbatches=2, timeout=PG_TIMEOUT)
    strategy.setup_environment()
    ref = reference_model()
    model = strategy.setup_module(copy.deepcopy(ref))
    optimizer = adamw(model.parameters(), lr=1e-2)
    ref_opt = adamw(ref.parameters(), lr=1e-2)
    kw = strategy.distributed_sampler_kwargs
    worst = 0.0
    for x, y in global_batches(2):
        per = x.shape[0] // kw["num_replicas"]
        sl = slice(kw["rank"] * per, (kw["rank"] + 1) * per)
        loss = strategy.pipeline_step(model, x[sl], y[sl], lm_loss)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        optimizer.step(), ref_opt.step(), optimizer.zero_grad(), ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    return worst


if __name__ == "__main__":
    main(Path(sys.argv[1]))
