"""Spawns shared by several test modules of one area (a spawn costs seconds, a case milliseconds)."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_distributed


def _context_and_expert_grids(root: str) -> dict[str, Any]:
    from test_context_parallel import kernel_and_strategy_grid
    from test_expert_parallel import grid as expert_grid

    return {**kernel_and_strategy_grid(root), "experts": expert_grid(f"{root}/experts")}


@pytest.fixture(scope="session")
def context_parallel_spawn(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 4-process run of the context-parallel kernel grid (``test_context_attention``), the context-parallel
    strategy grid (``test_context_parallel``) and the expert-parallel grid (``test_expert_parallel``)."""
    return run_distributed(_context_and_expert_grids, 4, str(tmp_path_factory.mktemp("cp")), timeout=540)
