"""The code in docs/*.md and in README.md's "Usage" section runs, and prints what
the page says it prints.

Each page is run like a notebook: its ```python blocks execute in order in one
namespace, so a later block may use what an earlier one defined. A ```text block
that follows a python block with nothing but blank lines between them is that
block's expected output: the captured stdout must match it line by line (trailing
spaces ignored). An HTML comment on the line just above a python block changes how
it runs (it is invisible on the rendered page):

* ``<!-- doctest: skip (why) -->``: not run (code for another library, ...).
* ``<!-- doctest: cuda -->``: run only where CUDA is available.
* ``<!-- doctest: module NAME -->``: written to ``NAME.py`` in a temporary folder
  and imported as module ``NAME`` (later blocks may ``from NAME import ...``;
  its names also join the page's namespace), so that the rank processes of
  ``remat_dist.testing.run_distributed`` can import its functions.
* ``<!-- doctest: alias OLD=NEW -->``: while the block runs, ``import OLD`` gives
  module ``NEW`` (the "before" code of the migration guide runs against
  remat_dist with only the import changed, which is the promise).

Everything runs in this process except the one cross-rank report example of
docs/reports.md, which runs on 4 ranks of the harness's reusable gloo pool.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import sys
import types
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

PAGES = ("rng.md", "reports.md", "migration.md", "distributed.md", "offloading.md", "testing.md")
"""Pages whose python blocks are run (index.md has none; mental_model.md shows
fragments of a model, not programs)."""

PENDING: set[str] = set()
"""Pages the index links to that other people are still writing: a link to one of
them may dangle until it lands; every other link must resolve."""

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    directive: str = ""
    expected: str | None = None
    is_output: bool = False  # a text block that is a python block's output


def parse_blocks(text: str) -> list[Block]:
    """Fenced blocks in order, with their directive and expected output."""
    lines = text.splitlines()
    blocks: list[Block] = []
    ends: list[int] = []  # index of each block's closing fence
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise AssertionError(f"unclosed code block at line {start + 1}")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        d = _DIRECTIVE.match(lines[k].strip()) if k >= 0 else None
        blocks.append(
            Block(
                lang=m.group(1),
                code="\n".join(lines[start + 1 : j]) + "\n",
                line=start + 1,
                directive=d.group(1) if d else "",
            )
        )
        ends.append(j)
        i = j + 1
    # a text block right after a python block is its output
    for n in range(len(blocks) - 1):
        cur, nxt = blocks[n], blocks[n + 1]
        gap = lines[ends[n] + 1 : nxt.line - 1]
        if (
            cur.lang == "python"
            and nxt.lang == "text"
            and not any(g.strip() for g in gap)
        ):
            cur.expected = nxt.code
            nxt.is_output = True
    return blocks


def _normalise(text: str) -> list[str]:
    out = [ln.rstrip() for ln in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


@contextlib.contextmanager
def _aliases(spec: str):
    """``OLD=NEW``: make ``import OLD`` (and ``from OLD import x``) give ``NEW``."""
    old, new = (s.strip() for s in spec.split("=", 1))
    target = importlib.import_module(new)
    added = []
    parts = old.split(".")
    for n in range(1, len(parts) + 1):
        name = ".".join(parts[:n])
        if name in sys.modules:
            continue
        sys.modules[name] = target if n == len(parts) else types.ModuleType(name)
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _run_module(
    block: Block, name: str, tmp_path: Path, namespace: dict, modules: list[str]
) -> None:
    assert name.isidentifier(), f"module name {name!r} is not an identifier"
    assert name not in sys.modules, f"module name {name!r} is taken"
    folder = tmp_path / uuid.uuid4().hex[:12]
    folder.mkdir()
    path = folder / f"{name}.py"
    path.write_text(block.code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    modules.append(name)
    spec.loader.exec_module(module)
    namespace.update({k: v for k, v in vars(module).items() if not k.startswith("__")})


def run_page(text: str, where: str, tmp_path: Path) -> int:
    """Run every python block of ``text``; returns how many ran."""
    modules: list[str] = []
    try:
        return _run_blocks(text, where, tmp_path, modules)
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def _run_blocks(text: str, where: str, tmp_path: Path, modules: list[str]) -> int:
    namespace: dict = {"__name__": "__doc_example__"}
    ran = 0
    for block in parse_blocks(text):
        if block.lang != "python":
            continue
        kind, _, arg = block.directive.partition(" ")
        if kind == "skip":
            assert arg.strip(), f"{where}:{block.line}: say why the block is skipped"
            continue
        if kind == "cuda" and not torch.cuda.is_available():
            continue
        assert kind in ("", "cuda", "module", "alias"), (
            f"{where}:{block.line}: unknown directive {block.directive!r}"
        )
        out = io.StringIO()
        alias = _aliases(arg) if kind == "alias" else contextlib.nullcontext()
        try:
            with alias, contextlib.redirect_stdout(out):
                if kind == "module":
                    _run_module(block, arg.strip(), tmp_path, namespace, modules)
                else:
                    code = compile(block.code, f"{where}:{block.line}", "exec")
                    exec(code, namespace)  # noqa: S102 - the docs are ours
        except Exception as e:
            raise AssertionError(
                f"the python block at {where}:{block.line} raised {e!r}\n"
                f"stdout so far:\n{out.getvalue()}"
            ) from e
        ran += 1
        if block.expected is not None:
            got, want = _normalise(out.getvalue()), _normalise(block.expected)
            assert got == want, (
                f"the python block at {where}:{block.line} printed\n"
                + "\n".join(got)
                + "\n\nbut the page shows\n"
                + "\n".join(want)
            )
    return ran


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run_and_print_what_the_page_shows(page, tmp_path):
    path = DOCS / page
    ran = run_page(path.read_text(), f"docs/{page}", tmp_path)
    assert ran > 0, f"docs/{page} has no python block that ran"


@pytest.mark.parametrize("page", PAGES)
def test_every_output_shown_is_checked(page):
    """A text block on these pages is a python block's output, placed right under
    it, so that the run above compares it (prose in between would hide it)."""
    for block in parse_blocks((DOCS / page).read_text()):
        if block.lang == "text":
            assert block.is_output, (
                f"docs/{page}:{block.line}: this text block follows no python block, "
                "so nothing checks it"
            )
        assert block.lang in ("python", "text"), (
            f"docs/{page}:{block.line}: fence the block as python or text"
        )


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m is not None, f"README.md has no '## {title}' section"
    return m.group(1)


def test_readme_usage_runs(tmp_path):
    assert run_page(_readme_section("Usage"), "README.md#usage", tmp_path) >= 2


_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _links(text: str) -> list[str]:
    return _LINK.findall(text)


def test_index_lists_every_page_and_its_links_resolve():
    index = (DOCS / "index.md").read_text()
    linked = set(_links(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not list {sorted(pages - linked)}"
    for target in linked:
        assert (DOCS / target).exists() or target in PENDING, (
            f"docs/index.md links to {target}, which does not exist"
        )


def test_links_between_pages_and_from_readme_resolve():
    sources = {f"docs/{p.name}": (DOCS, p.read_text()) for p in DOCS.glob("*.md")}
    sources["README.md"] = (ROOT, (ROOT / "README.md").read_text())
    for where, (base, text) in sources.items():
        for target in _links(text):
            resolved = (base / target).resolve()
            if resolved.parent == DOCS and resolved.name in PENDING:
                continue
            assert resolved.exists(), f"{where} links to {target}, which does not exist"


def test_readme_docs_section_lists_every_page():
    section = _readme_section("Docs")
    linked = {Path(t).name for t in _links(section)}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= linked, f"README.md's Docs section misses {sorted(pages - linked)}"


def test_the_runner_checks_output_and_reports_the_failing_block(tmp_path):
    good = "```python\nprint('a')\n```\n\n```text\na\n```\n"
    assert run_page(good, "x.md", tmp_path) == 1
    bad = good.replace("\na\n```\n", "\nb\n```\n")
    with pytest.raises(AssertionError, match=r"x\.md:1 printed"):
        run_page(bad, "x.md", tmp_path)
    broken = "```python\nraise ValueError('boom')\n```\n"
    with pytest.raises(AssertionError, match=r"x\.md:1 raised ValueError"):
        run_page(broken, "x.md", tmp_path)
    skipped = "<!-- doctest: skip (not ours) -->\n```python\nimport nope\n```\n"
    assert run_page(skipped, "x.md", tmp_path) == 0
