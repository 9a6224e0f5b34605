"""Process state lives in one object per concern, and one call resets them all."""

from __future__ import annotations

import remat_dist  # registers every concern
from remat_dist._state import registered_states
from remat_dist.testing import reset_process_state


def test_every_concern_is_registered():
    assert {
        "distributed.default_state_hooks",
        "distributed.step",
        "distributed.step_hooks",
        "distributed.fsdp_tracking",
        "report.saved_attrs",
    } <= set(registered_states())
    assert all(
        callable(getattr(s, "reset", None)) for s in registered_states().values()
    )


def test_reset_clears_the_caches_and_the_replay_timeout():
    import remat_dist as remat
    from remat_dist.distributed import _rng_default, _step

    _rng_default._single_process_hooks()
    remat.distributed.set_replay_timeout(3.0)
    assert _rng_default._CACHE.single
    reset_process_state()
    assert not _rng_default._CACHE.single and not _rng_default._CACHE.provider
    assert _step.replay_timeout() == _step.REPLAY_TIMEOUT_S


def test_no_module_rebinds_a_global():
    """Process state is changed through its object, never by rebinding a module
    global (``global x`` hides state that no reset can find)."""
    import ast
    import pathlib

    root = pathlib.Path(remat_dist.__file__).parent
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    ]
    assert not found, f"`global` statements: {found}"
