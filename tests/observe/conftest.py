"""Each test starts with an empty process registry (it is process-global, like a logger)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncflow_actors import observe


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    observe.get_registry().clear()
    yield
    assert not observe.get_tracer().enabled, "a test left the process tracer on"
