"""Every test under ``tests/gpu`` carries the ``gpu`` marker and is skipped without CUDA (CI never needs them).

``MODELPAR_GPU_SUITE_DEVICE=cpu`` runs them on CPU processes instead: a self-check of the suite's own code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_common import suite_available

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available, reason = suite_available()
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not available:
                item.add_marker(pytest.mark.skip(reason=reason))
