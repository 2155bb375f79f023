"""Meta-device init and the Llama plan's output on CPU meshes, against a single-process reference.

DTensor has no random-number support on CPU meshes; materialization must still give every rank its slice
of the model a single process builds from the same seed (not one shard repeated), and do it without torch's
"DTensor random operators" warning. The plan's logits must not be a view, so in-place ops on them work.
One spawn of 4 processes runs the meshes 2x2 (FSDP over TP: strided shards) and 1x4.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from harness import run_distributed
from modelpar.models import Llama
from parity import CFG, assert_matches, global_batches, lm_loss, local_slice, make_fabric, reference_model


def case_meta_init_equals_reference_and_logits_take_in_place_ops(dp: int, tp: int) -> list[str]:
    fabric = make_fabric(dp, tp, world_size=4)
    torch.manual_seed(0)  # the seed reference_model(0) uses, on every rank
    with fabric.init_module(empty_init=True):
        model = Llama(CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fabric.setup_module(model)
        ref = reference_model(0)
        assert_matches(model, ref, "param", atol=0, rtol=0)
        x, y = global_batches(1)[0]
        logits = model(local_slice(fabric, x))
        assert logits._base is None, "the logits are a view"
        logits.mul_(2.0)  # raised "a view ... is being modified inplace" when the plan returned a view
        fabric.backward(lm_loss(logits, local_slice(fabric, y)))
    lm_loss(ref(x) * 2.0, y).backward()
    assert_matches(model, ref, "grad")
    return [str(w.message) for w in caught]


def grid() -> dict[str, list[str]]:
    return {
        f"{dp}x{tp}": case_meta_init_equals_reference_and_logits_take_in_place_ops(dp, tp)
        for dp, tp in ((2, 2), (1, 4))
    }


def test_meta_init_on_cpu_meshes_equals_the_single_process_model_and_logits_are_not_views() -> None:
    results: list[dict[str, Any]] = run_distributed(grid, 4)
    for rank_result in results:
        for layout, messages in rank_result.items():
            noisy = [m for m in messages if "DTensor random operators" in m or "returned a view tensor" in m]
            assert not noisy, f"{layout}: {noisy}"
