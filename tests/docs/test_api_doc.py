"""docs/api.md is generated from the docstrings and must be current, and the
generator writes the same text under every Python it runs on."""

import enum
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_api_reference_is_current_and_complete():
    expected = _generator().render()  # raises when a public name has no section
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == expected, "docs/api.md is stale: run python scripts/gen_api_docs.py"


class Kind(enum.Enum):
    """A mode."""

    FAST = "fast"


def _every_kind(
    x: "int",
    /,
    mode: "Kind" = Kind.FAST,
    *rest: "int",
    sizes: "tuple[int, ...]" = (1,),
    **kw: "str",
) -> "None":
    """Positional-only, an enum default, *args, a tuple default, **kwargs."""


def test_signatures_are_spelled_the_same_under_every_python():
    # str(inspect.signature(...)) writes an enum default as repr() does, which is
    # "<Kind.FAST: 'fast'>" and changed in Python 3.12, and an Enum class's own
    # signature is its metaclass's, which changes with nearly every release
    gen = _generator()
    assert gen._signature(_every_kind, "f") == (
        "(x: int, /, mode: Kind = Kind.FAST, *rest: int, sizes: tuple[int, ...] = (1,), "
        "**kw: str) -> None"
    )
    assert gen._signature(Kind, "Kind") == "(enum.Enum)"


def test_a_default_without_a_stable_spelling_stops_the_generation():
    gen = _generator()
    marker = object()  # its repr holds an address: different on every run

    def uses_a_marker(x=marker):
        """One default."""

    with pytest.raises(SystemExit, match=r"uses_a_marker\(x\)"):
        gen._signature(uses_a_marker, "uses_a_marker")
