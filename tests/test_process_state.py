"""Process state lives in one object per concern, and one call resets them all."""

from __future__ import annotations

import remat_dist  # noqa: F401  (registers every concern)
from remat_dist._state import registered_states
from remat_dist.testing import reset_process_state


def test_every_concern_is_registered():
    assert {
        "distributed.default_state_hooks",
        "distributed.step",
        "distributed.fsdp_tracking",
        "report.saved_attrs",
    } <= set(registered_states())
    assert all(callable(getattr(s, "reset", None)) for s in registered_states().values())


def test_reset_clears_the_caches_and_the_replay_timeout():
    import remat_dist as remat
    from remat_dist.distributed import _rng_default, _step

    _rng_default._single_process_hooks()
    remat.set_replay_timeout(3.0)
    assert _rng_default._CACHE.single
    reset_process_state()
    assert not _rng_default._CACHE.single and not _rng_default._CACHE.provider
    assert _step.replay_timeout() == _step.REPLAY_TIMEOUT_S
