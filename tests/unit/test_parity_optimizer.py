"""The parity tests' optimizer (``parity.adamw``): a gradient's rounding must not become a layout difference.

Every distributed test trains against a one-process reference and compares the weights within ``ATOL``; the two
sides sum in different orders, so a gradient that is only rounding noise differs between them. Adam scales such a
gradient up to a step of the learning rate's size; these checks pin down why the tests' eps is 1e-6.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from parity import ATOL, PARITY_EPS, adamw

LR = 1e-2
NOISE = 3.1e-9  # a Qwen3 gate projection's gradient at the first step, where the tensor's largest was 2.6e-3
ROUNDING = 1.5e-10  # what another summation order changes in it


def _one_step(make: Callable[..., torch.optim.Optimizer], grad: float) -> float:
    weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = make([weight], lr=LR, weight_decay=0.1)
    weight.grad = torch.tensor([grad], dtype=torch.float64)
    optimizer.step()
    return weight.item()


def test_torch_s_default_eps_turns_the_rounding_of_a_noise_gradient_into_a_weight_difference_past_atol() -> None:
    apart = abs(_one_step(torch.optim.AdamW, NOISE) - _one_step(torch.optim.AdamW, NOISE + ROUNDING))
    assert apart > 4 * ATOL, apart  # 8.6e-5: what failed the parity tests on an AMD EPYC


def test_the_parity_eps_keeps_that_difference_far_inside_atol() -> None:
    apart = abs(_one_step(adamw, NOISE) - _one_step(adamw, NOISE + ROUNDING))
    assert apart < ATOL / 10, apart


@pytest.mark.parametrize("grad", [1e-4, 1e-3, 1e-2])
def test_real_gradients_are_stepped_as_with_torch_s_default(grad: float) -> None:
    ours, torch_s = _one_step(adamw, grad), _one_step(torch.optim.AdamW, grad)
    assert ours == pytest.approx(torch_s, rel=PARITY_EPS / grad * 1.01), (ours, torch_s)


def test_an_explicit_eps_wins() -> None:
    assert adamw([torch.nn.Parameter(torch.zeros(1))], lr=LR, eps=1e-8).param_groups[0]["eps"] == 1e-8
    assert adamw([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["eps"] == PARITY_EPS
