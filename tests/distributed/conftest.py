"""Spawns shared by several test modules of one area (a spawn costs seconds, a case milliseconds)."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_distributed


@pytest.fixture(scope="session")
def context_parallel_spawn(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 4-process run of the kernel grid (``test_context_attention``) and the strategy grid (``test_context_parallel``)."""
    from test_context_parallel import kernel_and_strategy_grid

    return run_distributed(kernel_and_strategy_grid, 4, str(tmp_path_factory.mktemp("cp")), timeout=420)
