"""Suite-wide pytest set-up.

* Test directories are packages (``tests/**/__init__.py``) imported from the
  repository root, so the rank processes of ``remat_dist.testing`` can import a test
  module (and the functions in it) by name.
* Each pytest-xdist worker gets its share of the CPU threads instead of all of
  them (``-n auto`` on a 2-core machine would otherwise oversubscribe 2x).
* Tests marked ``gpu`` are skipped without a CUDA device.
* The harness's rank processes are killed when the session ends.
* Every test starts from reset process state (``reset_process_state``: caches, the
  step's agreement state, FSDP2's tracking), whatever the test before it left.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_process_state() -> None:
    from remat_dist.testing import reset_process_state

    reset_process_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from remat_dist.testing import shutdown_pools

    shutdown_pools()
