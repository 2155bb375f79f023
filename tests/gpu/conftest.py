"""Every test under ``tests/gpu`` carries the ``gpu`` marker and is skipped without CUDA (CI never needs them),
but the suite's own rules (:data:`RUN_WITHOUT_CUDA`).

``MODELPAR_GPU_SUITE_DEVICE=cpu`` runs them on CPU processes instead: a self-check of the suite's own code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_common import DEVICE_VARIABLE, suite_available

_HERE = Path(__file__).parent

#: The suite's own rules and the benchmark's reports, tested in this process in seconds: without CUDA they run as
#: in the CPU self-check (:func:`_self_check_without_cuda`), so that CI, not a task's one GPU run, finds a broken
#: skip rule or summary line first.
RUN_WITHOUT_CUDA = frozenset({"test_gpu_suite_itself.py"})


@pytest.fixture(autouse=True)
def _self_check_without_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA, the tests of :data:`RUN_WITHOUT_CUDA` see ``MODELPAR_GPU_SUITE_DEVICE=cpu``: their cases compute
    on the CPU, as ``MODELPAR_GPU_SUITE_DEVICE=cpu pytest tests/gpu`` runs them (on a GPU they see CUDA)."""
    if Path(str(request.node.fspath)).name in RUN_WITHOUT_CUDA and not suite_available()[0]:
        monkeypatch.setenv(DEVICE_VARIABLE, "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available, reason = suite_available()
    for item in items:
        path = Path(str(item.fspath))
        if _HERE in path.parents:
            item.add_marker(pytest.mark.gpu)
            if not available and path.name not in RUN_WITHOUT_CUDA:
                item.add_marker(pytest.mark.skip(reason=reason))
