"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: the single-process reference runs beside the ranks,
    and more threads than cores make OpenMP spin-wait (seconds per step on a loaded 2-core
    box, not ms). Ranks set their own counts; this process's count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
