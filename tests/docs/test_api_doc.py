"""docs/api.md is generated from the docstrings and must be current."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_is_current_and_complete():
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.render()  # raises when a public name has no section
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == expected, "docs/api.md is stale: run python scripts/gen_api_docs.py"
