"""Spawns shared by several test modules of one area (a spawn costs seconds, a case milliseconds)."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_distributed


@pytest.fixture(scope="session")
def context_parallel_spawn(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 4-process run of the context-parallel kernel grid (``test_context_attention``), the context-parallel
    strategy grid (``test_context_parallel``), the expert-parallel grid (``test_expert_parallel``) and the Hugging
    Face MoE router-loss case (``test_hf_router_loss``)."""
    from test_expert_parallel import context_and_expert_grids  # a module spawned processes can import by name

    return run_distributed(context_and_expert_grids, 4, str(tmp_path_factory.mktemp("cp")), timeout=540)
