"""Mesh-aware clipping on plain tensors must behave exactly like torch's own clipping."""

import pytest
import torch

from modelpar import clip_grad_norm, clip_grad_value


def _params(seed=0):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(2))]
    for p in ps[:2]:
        p.grad = torch.randn_like(p)
    return ps  # the last one has no gradient


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_plain_tensors(norm_type):
    ours, theirs = _params(), _params()
    got = clip_grad_norm(ours, max_norm=0.5, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.5, norm_type=norm_type)
    torch.testing.assert_close(got, want)
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_grad_value_equals_torch_on_plain_tensors():
    ours, theirs = _params(), _params()
    clip_grad_value(ours, 0.3)
    torch.nn.utils.clip_grad_value_(theirs, 0.3)
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_nonfinite_norm_raises_with_the_fix():
    ps = _params()
    ps[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"is nan, so they cannot be clipped.*`error_if_nonfinite=False`"):
        clip_grad_norm(ps, 1.0)
    clip_grad_norm(ps, 1.0, error_if_nonfinite=False)


def test_no_gradients_gives_zero_norm():
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
