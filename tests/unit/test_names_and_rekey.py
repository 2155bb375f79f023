"""Stable checkpoint names across wrappers, and optimizer re-keying by position <-> name (one process)."""

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from modelpar.checkpoint import (
    clean_name,
    load_state,
    optimizer_state_to_names,
    optimizer_state_to_positions,
    save_state,
)
from parity import global_batches, lm_loss, reference_model


def wrapped_model():
    """Block 0 under an activation-checkpoint wrapper, block 1 compiled (compilation itself is lazy)."""
    model = reference_model()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    model.layers[1] = torch.compile(model.layers[1])
    return model


def trained(model):
    """One AdamW step with fixed gradients (the compiled block is never run, so nothing compiles)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    return opt


def test_clean_name_strips_fsdp1_checkpoint_and_compile_segments():
    assert (
        clean_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )
    assert clean_name("layers.0._checkpoint_wrapped_module.ffn_norm.weight") == "layers.0.ffn_norm.weight"
    assert clean_name("layers.1._orig_mod.feed_forward.w1.weight") == "layers.1.feed_forward.w1.weight"


@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
def test_a_checkpoint_saved_with_wrappers_loads_into_a_plain_model_and_back(tmp_path, full):
    wrapped = wrapped_model()
    opt = trained(wrapped)
    save_state(tmp_path / "w", {"model": wrapped, "optimizer": opt}, full=full)
    if full:
        keys = torch.load(tmp_path / "w", weights_only=True)["model"].keys()
        assert not any(seg in k for k in keys for seg in ("_orig_mod", "_checkpoint_wrapped"))
    plain = reference_model(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    load_state(tmp_path / "w", {"model": plain, "optimizer": plain_opt})
    want = {clean_name(k): v for k, v in wrapped.state_dict().items()}
    torch.testing.assert_close(plain.state_dict(), want, atol=0, rtol=0)
    # and back: plain -> wrapped
    save_state(tmp_path / "p", {"model": plain, "optimizer": plain_opt}, full=full)
    again = wrapped_model()
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    load_state(tmp_path / "p", {"model": again, "optimizer": again_opt})
    torch.testing.assert_close({clean_name(k): v for k, v in again.state_dict().items()}, want, atol=0, rtol=0)
    moments = [s["exp_avg"] for s in again_opt.state.values()]
    assert moments and all(torch.allclose(m, torch.full_like(m, 0.001)) for m in moments)


def groups_with_frozen():
    model = reference_model()
    model.tok_embeddings.weight.requires_grad_(False)  # frozen: not in the optimizer
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "lr": 5e-3}], lr=1e-2)
    x, y = global_batches(1)[0]
    lm_loss(model(x), y).backward()
    opt.step()
    return model, opt


def test_rekeying_round_trips_with_several_groups_and_frozen_parameters():
    model, opt = groups_with_frozen()
    by_position = opt.state_dict()
    by_name = optimizer_state_to_names(copy.deepcopy(by_position), model, opt)
    assert "tok_embeddings.weight" not in by_name["state"]  # frozen
    assert by_name["param_groups"][0]["params"][0] == "layers.0.attention_norm.weight"
    assert by_name["param_groups"][1]["lr"] == 5e-3
    torch.testing.assert_close(
        by_name["state"]["layers.1.feed_forward.w2.weight"]["exp_avg"],
        opt.state[model.layers[1].feed_forward.w2.weight]["exp_avg"],
    )
    back = optimizer_state_to_positions(by_name, model, opt)
    torch.testing.assert_close(back["state"], by_position["state"])
    assert back["param_groups"] == by_position["param_groups"]
    fresh = torch.optim.AdamW([{"params": opt.param_groups[0]["params"]}, {"params": opt.param_groups[1]["params"]}])
    fresh.load_state_dict(back)  # what a DDP / single-device run does with it


def test_rekeying_with_other_groups_says_what_differs():
    model, opt = groups_with_frozen()
    other = torch.optim.AdamW(model.layers.parameters())
    with pytest.raises(ValueError, match=r"parameter groups of sizes \[\d+, \d+\], the optimizer has \[\d+\]"):
        optimizer_state_to_names(opt.state_dict(), model, other)
