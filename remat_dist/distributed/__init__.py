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

__all__ = [
    "CPURNGStateHook",
    "DTensorRNGStateHook",
    "DeviceRNGStateHook",
    "GeneratorStateHook",
    "default_state_hooks",
    "install_default_provider",
    "rank_device",
]
