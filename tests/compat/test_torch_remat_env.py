"""``REMAT_DIST_AS_TORCH_REMAT=1`` through the ``.pth`` file the package ships.

Each test runs real interpreters of a throwaway virtual environment whose
site-packages holds the shipped ``remat_dist_torch_remat.pth`` (as a wheel install
puts it) and reaches this environment's packages (torch, remat_dist) through a
second ``.pth``. Nothing in the test process is changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

import remat_dist
from remat_dist import _torch_remat_env

REPO = Path(__file__).resolve().parents[2]
VAR = "REMAT_DIST_AS_TORCH_REMAT"
SERVED = "torch_remat is served by remat_dist " + remat_dist.__version__


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    """The interpreter of a venv with the shipped ``.pth`` in its site-packages."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    exe = root / "bin" / "python"
    site = subprocess.run(
        [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # "a_" sorts before the shipped file, as site-packages' own .pth files would;
    # the checkout comes last, for a run of the suite without remat-dist installed
    Path(site, "a_this_env.pth").write_text(
        f"import site, sys; site.addsitedir({ours!r}); sys.path.append({str(REPO)!r})\n"
    )
    shipped = (REPO / _torch_remat_env.PTH_NAME).read_text()
    Path(site, _torch_remat_env.PTH_NAME).write_text(shipped)
    return str(exe)


def _run(python: str, code: str, value: str | None, *args: str, **env: str):
    environ = {k: v for k, v in os.environ.items() if k not in (VAR, "PYTHONPATH")}
    if value is not None:
        environ[VAR] = value
    environ.update(env)
    return subprocess.run(
        [python, *args, "-c", textwrap.dedent(code)] if code else [python, *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=REPO,
        timeout=300,
    )


def test_shipped_line_is_one_cheap_import_line():
    lines = (REPO / _torch_remat_env.PTH_NAME).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import os, importlib.util as u;")
    assert VAR in lines[0] and "_torch_remat_env.py" in lines[0]


@pytest.mark.parametrize("value", [None, "0", "", "off"])
def test_unset_or_off_does_nothing(python, value):
    out = _run(
        python,
        """
        import sys
        print(sorted(m for m in ("torch", "remat_dist") if m in sys.modules))
        print([type(f).__name__ for f in sys.meta_path if "Remat" in type(f).__name__])
    """,
        value,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]
    assert out.stderr == ""


@pytest.mark.slow
def test_set_serves_torch_remat_lazily_with_one_line(python):
    out = _run(
        python,
        """
        import sys
        print(sorted(m for m in ("torch", "remat_dist") if m in sys.modules))
        import torch_remat
        import torch_remat as again
        import remat_dist
        print(torch_remat is remat_dist is again)
        x = __import__("torch").ones(3, requires_grad=True)
        torch_remat.checkpoint(region_name="layers.0")(lambda t: t.sin())(x).sum().backward()
        print(x.grad.sum().item() > 0)
    """,
        "1",
    )
    assert out.returncode == 0, out.stderr
    # nothing imported before torch_remat is: processes that never use it pay nothing
    assert out.stdout.split("\n")[:3] == ["[]", "True", "True"]
    served = [line for line in out.stderr.splitlines() if SERVED in line]
    assert len(served) == 1, out.stderr
    assert f"because {VAR}=1" in served[0]
    assert "installed torch_remat" not in served[0]


@pytest.mark.slow
def test_replaces_an_installed_torch_remat(python, tmp_path):
    package = tmp_path / "torch_remat"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    info = tmp_path / "torch_remat-0.2.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch_remat\nVersion: 0.2.2\n"
    )
    code = "import torch_remat; print(getattr(torch_remat, 'REAL', False))"
    without = _run(python, code, None, PYTHONPATH=str(tmp_path))
    assert without.stdout.strip() == "True", without.stderr
    served = _run(python, code, "1", PYTHONPATH=str(tmp_path))
    assert served.stdout.strip() == "False", served.stderr
    assert "the installed torch_remat 0.2.2 is not used" in served.stderr


def test_a_value_neither_on_nor_off_refuses_loudly(python):
    out = _run(
        python,
        """
        try:
            import torch_remat
        except ImportError:
            print("fell back")
    """,
        "maybe",
        RANK="1",
    )
    assert out.returncode != 0 and "fell back" not in out.stdout
    assert "TorchRematAliasError" in out.stderr
    assert f"remat_dist [rank 1]: {VAR}='maybe' asks remat_dist" in out.stderr
    assert f"Fix: set {VAR}=1" in out.stderr


def test_remat_dist_failing_to_import_refuses(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    monkeypatch.setitem(sys.modules, "remat_dist.compat", None)  # import fails
    with pytest.raises(_torch_remat_env.TorchRematAliasError) as info:
        _torch_remat_env.serve()
    msg = str(info.value)
    assert "importing remat_dist failed" in msg and f"unset {VAR}" in msg
    assert not isinstance(info.value, ImportError)


@pytest.mark.slow
def test_two_rank_torchrun_each_rank_says_who_serves(python, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import os
        import torch_remat
        import remat_dist
        assert torch_remat is remat_dist
        print("rank", os.environ["RANK"], "ok", flush=True)
    """)
    )
    out = _run(
        python,
        "",
        "1",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(line for line in out.stdout.splitlines() if " ok" in line) == [
        "rank 0 ok",
        "rank 1 ok",
    ]
    for rank in (0, 1):
        lines = [x for x in out.stderr.splitlines() if f"[rank {rank}]: {SERVED}" in x]
        assert len(lines) == 1, out.stderr
    # the launcher itself never imported torch_remat
    assert sum(SERVED in x for x in out.stderr.splitlines()) == 2
