"""Batched clipping on plain tensors: many tensors, mixed dtypes, empty ones (the communication device:
``test_collective_device.py``)."""

import pytest
import torch

from modelpar import clip_grad_norm


def _many_params(n, dtypes=(torch.float32,), seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i in range(n):
        dtype = dtypes[i % len(dtypes)]
        p = torch.nn.Parameter(torch.zeros(i % 7 + 1, 3, dtype=dtype))
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
        ps.append(p)
    return ps


def _exact_norm(grads, norm_type):
    flat = torch.cat([g.double().flatten() for g in grads])
    return torch.linalg.vector_norm(flat, norm_type)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_a_thousand_tensors(norm_type):
    ours, theirs = _many_params(1000), _many_params(1000)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.5, norm_type=norm_type)
    got = clip_grad_norm(ours, max_norm=0.5, norm_type=norm_type)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("norm_type", [2.0, 3.0, float("inf")])
def test_mixed_dtypes_are_normed_per_dtype_and_scaled_in_their_own_dtype(norm_type):
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    ps = _many_params(30, dtypes)
    before = [p.grad.clone() for p in ps]
    want = _exact_norm(before, norm_type)
    got = clip_grad_norm(ps, max_norm=0.1, norm_type=norm_type)
    assert got.dtype == torch.float32  # the first gradient's dtype, as torch returns it
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=0)  # bf16 per-tensor norms, as in torch
    coef = 0.1 / (float(got) + 1e-6)
    for p, g in zip(ps, before, strict=True):
        assert p.grad.dtype == g.dtype
        torch.testing.assert_close(p.grad, (g.double() * coef).to(g.dtype), rtol=1e-2, atol=1e-6)


def test_norm_below_max_leaves_gradients_unchanged():
    ps = _many_params(10)
    before = [p.grad.clone() for p in ps]
    clip_grad_norm(ps, max_norm=1e6)
    for p, g in zip(ps, before, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_inf_gradient_raises_with_the_fix_and_scales_anyway_when_allowed():
    ps, theirs = _many_params(5), _many_params(5)
    ps[3].grad[0, 0] = theirs[3].grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"is inf, so they cannot be clipped.*`error_if_nonfinite=False`"):
        clip_grad_norm(ps, 1.0)
    got = clip_grad_norm(ps, 1.0, error_if_nonfinite=False)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=False)
    torch.testing.assert_close(got, want)
    for a, b in zip(ps, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_empty_gradients_add_nothing_even_to_the_inf_norm(norm_type):
    # An uneven shard is empty on some ranks; torch's inf-norm refuses empty tensors ("no identity").
    ps = [*_many_params(3), torch.nn.Parameter(torch.zeros(0, 3))]
    ps[-1].grad = torch.zeros(0, 3)
    want = _exact_norm([p.grad for p in ps[:3]], norm_type)
    torch.testing.assert_close(clip_grad_norm(ps, 1e6, norm_type).double(), want, rtol=1e-6, atol=0)
    empty = torch.nn.Parameter(torch.zeros(0))
    empty.grad = torch.zeros(0)
    assert clip_grad_norm([empty], 1.0, norm_type).item() == 0.0
