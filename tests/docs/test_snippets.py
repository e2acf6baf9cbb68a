"""The Python snippets of the docs run as written (a snippet that drifted from a signature,
like ``save_model``'s keyword-only ``tokenizer``, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
SNIPPETS = [
    pytest.param(page, i, code, id=f"{page}#{i}")
    for page in ("models.md", "algorithms.md")
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S))
]


@pytest.mark.parametrize(("page", "index", "code"), SNIPPETS)
def test_snippet_runs(page: str, index: int, code: str) -> None:
    exec(compile(code, f"{page} snippet {index}", "exec"), {"__name__": "snippet"})


def test_save_model_signature_matches_the_docs(tmp_path: Path) -> None:
    """docs/models.md: ``save_model(path, model, *, tokenizer=None)``."""
    import inspect

    from asyncflow_actors.models import save_model

    params = inspect.signature(save_model).parameters
    assert params["tokenizer"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "save_model(path, model, *, tokenizer=None)" in (DOCS / "models.md").read_text()
