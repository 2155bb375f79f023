"""Hugging Face pretrained weights into and out of sharded models: one spawn of 4 CPU processes, a grid inside.

A tiny Llama (``transformers``) is built on the meta device with ``fabric.init_module(empty_init=True)``, set up
by our strategy with the model's own plan (``modelpar.hf.plan_for``: tensor parallelism on the attention and MLP
projections and the LM head, FSDP2 per decoder layer and on the root), and filled with ``load_pretrained``. On every rank each local shard
must equal, exactly, what FSDP2 holds after sharding ``from_pretrained``'s model with the same plan; buffers
the files do not hold (rotary ``inv_freq``) must equal ``from_pretrained``'s; and the logits must match. On
2x2, one AdamW step later, ``save_pretrained`` writes a folder whose ``from_pretrained`` has the sharded
model's gathered weights bit for bit and its logits. 4x1 (with tied embeddings) and HSDP 2x2x1 load too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM

import modelpar.hf
from harness import run_distributed
from hf_tiny import tiny_config
from modelpar.hf import plan_for
from modelpar.plans import ParallelPlan
from parity import adamw, make_fabric


def plan(tied: bool) -> ParallelPlan:
    """The model's own Hugging Face plan (built from a meta-device model: a plan is data)."""
    with torch.device("meta"):
        return plan_for(AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=tied)))


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(3))


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


def sharded_model(fabric: Any, folder: Path, tied: bool) -> Any:
    torch.manual_seed(11)  # not the folder's seed: a tensor left unloaded would show
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=tied))
    model = fabric.setup_module(model)
    modelpar.hf.load_pretrained(model, folder)
    return model


def check_shards(model: Any, folder: Path, mesh: DeviceMesh, where: str, tied: bool = False) -> None:
    """Local shards equal FSDP2's own shards of ``from_pretrained``'s model; buffers equal its buffers."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    buffers = {name: b.clone() for name, b in reference.named_buffers()}
    held = plan(tied)(reference, mesh).state_dict()
    got = model.module.state_dict()
    assert list(got) == list(held), where
    for name, value in got.items():
        want = held[name]
        assert isinstance(value, DTensor) and isinstance(want, DTensor), f"{where} {name}"
        assert value.placements == want.placements, f"{where} {name}"
        local, want_local = value.to_local(), want.to_local()
        assert local.dtype == want_local.dtype == torch.float32, f"{where} {name}"
        assert local.shape == want_local.shape, f"{where} {name}: {local.shape} vs {want_local.shape}"
        assert torch.equal(local, want_local), f"{where} {name} on rank {dist.get_rank()}"
    for name, buffer in model.module.named_buffers():
        assert torch.equal(buffer, buffers[name]), f"{where} buffer {name}"


def grid(root: Path) -> dict[str, Any]:
    import time

    start = time.monotonic()
    done: dict[str, Any] = {}
    untied, tied = root / "untied", root / "tied"
    want = logits(AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32))

    # 2x2: TP inside FSDP2, with _StridedShard on the column-parallel weights
    fabric = make_fabric(2, 2, world_size=4, num_nodes=2, parallelize_fn=plan(False))
    model = sharded_model(fabric, untied, tied=False)
    check_shards(model, untied, fabric.strategy.device_mesh, "2x2")
    torch.testing.assert_close(logits(model), want, atol=1e-5, rtol=1e-5)  # TP sums in another order
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2))
    x = tokens()
    fabric.backward(model(input_ids=x, labels=x).loss)
    optimizer.step()
    trained = logits(model)
    assert not torch.allclose(trained, want)
    gathered = {k: v.full_tensor() for k, v in model.module.state_dict().items()}
    modelpar.hf.save_pretrained(model, root / "export", max_shard_size="40KB")
    if dist.get_rank() == 0:
        back = AutoModelForCausalLM.from_pretrained(root / "export")
        for name, value in back.state_dict().items():
            assert torch.equal(value, gathered[name]), f"export {name}"
        torch.testing.assert_close(logits(back), trained, atol=1e-5, rtol=1e-5)
        done["export files"] = len(list((root / "export").glob("model-*.safetensors")))
    dist.barrier()
    done["2x2"] = time.monotonic() - start

    # 4x1 (FSDP2 alone) with tied embeddings: the logits are computed exactly as on one process
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, parallelize_fn=plan(True))
    model = sharded_model(fabric, tied, tied=True)
    assert model.module.lm_head.weight is model.module.model.embed_tokens.weight
    check_shards(model, tied, fabric.strategy.device_mesh, "4x1 tied", tied=True)
    assert torch.equal(logits(model), logits(AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)))
    done["4x1"] = time.monotonic() - start

    # HSDP 2x2x1: replicate x shard
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, data_parallel_replicate_size=2, parallelize_fn=plan(False))
    assert tuple(fabric.strategy.device_mesh.shape) == (2, 2, 1)
    model = sharded_model(fabric, untied, tied=False)
    check_shards(model, untied, fabric.strategy.device_mesh, "2x2x1")
    assert torch.equal(logits(model), want)
    done["2x2x1"] = time.monotonic() - start
    return done


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for tied in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=tied))
        # the folder in bf16, sharded with an index: cast and file lookup on the way in
        model.to(torch.bfloat16).save_pretrained(root / ("tied" if tied else "untied"), max_shard_size="30KB")
    return root


def test_pretrained_weights_load_into_2x2_4x1_and_hsdp_shards_exactly_and_export_back(folders):
    results = run_distributed(grid, 4, folders, nodes=2, timeout=180)
    assert results[0]["export files"] > 1
    assert all(r["2x2"] and r["4x1"] and r["2x2x1"] for r in results)
