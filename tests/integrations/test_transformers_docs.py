"""docs/transformers.md runs and prints what it shows (the page needs transformers,
a test extra, so it is run here rather than in tests/docs with the pages that need
torch only)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.docs.test_doc_examples import parse_blocks, run_page  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


def test_transformers_page_runs_and_prints_what_it_shows(tmp_path):
    assert run_page(PAGE.read_text(), "docs/transformers.md", tmp_path) >= 4


def test_every_output_shown_is_checked():
    for block in parse_blocks(PAGE.read_text()):
        assert block.lang in ("python", "text")
        if block.lang == "text":
            assert block.is_output, f"docs/transformers.md:{block.line}: unchecked output"
