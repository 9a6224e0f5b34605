"""Rank-aware pieces of remat_dist, plugged into the core through its seams.

Importing this package (``import remat_dist`` does) installs the default state-hook
provider: with a process group, ``checkpoint`` keeps this rank's RNG aligned on
replay without user code (see :func:`default_state_hooks`).
"""

from remat_dist.distributed.rng import (
    CPURNGStateHook,
    DeviceRNGStateHook,
    DTensorRNGStateHook,
    GeneratorStateHook,
    default_state_hooks,
    install_default_provider,
    rank_device,
)

install_default_provider()

_REPORT_ALIASES = ("CrossRankReport", "gather_saved_tensors_report")


def __getattr__(name: str):
    # API.md lists the cross-rank report under remat_dist.distributed; it lives in
    # remat_dist.report (a layer above), so it is resolved lazily, not imported.
    if name in _REPORT_ALIASES:
        import remat_dist.report

        return getattr(remat_dist.report, name)
    raise AttributeError(f"module 'remat_dist.distributed' has no attribute {name!r}")

__all__ = [
    "CPURNGStateHook",
    "DTensorRNGStateHook",
    "DeviceRNGStateHook",
    "GeneratorStateHook",
    "default_state_hooks",
    "install_default_provider",
    "rank_device",
]
