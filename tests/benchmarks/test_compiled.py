"""``python -m benchmarks.compiled`` on a tiny size (backend aot_eager): the
table and the JSON, with saved bytes in the expected order."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_compile_cli(tmp_path, capsys):
    from benchmarks.compiled import main

    out = tmp_path / "bench.json"
    code = main([
        "--backend", "aot_eager", "--dim", "32", "--heads", "4",
        "--seq", "16", "--batch", "2", "--layers", "2", "--iters", "1", "--warmup", "1",
        "--json", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "compiled remat attention kept" in printed and "x torch" in printed
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    saved = {v: r["saved_bytes"] for v, r in rows.items()}
    # full remat keeps what compiled torch.utils.checkpoint keeps (block inputs and
    # one generator state per block); keeping the attention keeps more, less than none
    assert saved["compiled remat full"] == saved["compiled torch.utils.checkpoint"]
    assert saved["compiled remat full"] < saved["compiled remat attention kept"]
    assert saved["compiled remat attention kept"] < saved["compiled none"]
    assert rows["compiled torch.utils.checkpoint"]["x_torch"] == 1.0
    assert all(r["time_ms"] > 0 and r["backend"] == "aot_eager" for r in rows.values())


def test_bench_compile_refuses_eager_backend(capsys):
    """backend "eager" keeps save regions in torch's selective-checkpoint storage,
    which the saved-bytes column cannot see: not offered."""
    from benchmarks.compiled import main

    with pytest.raises(SystemExit):
        main(["--backend", "eager"])
    assert "invalid choice: 'eager'" in capsys.readouterr().err
