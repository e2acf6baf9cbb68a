"""Fixtures shared by every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny tensors gain nothing from intra-op threads, and on shared cores the threads of
    # one test spin-wait on each other (10x slowdowns); one thread is also bit-reproducible.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
