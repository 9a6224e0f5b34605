"""remat_dist's benchmarks: its own measurements, kept beside the package.

Nothing here ships in the wheel (``pyproject.toml`` packages ``remat_dist*``
only) and nothing in ``remat_dist/`` imports it. Run each one as a module from the
root of a checkout, where ``benchmarks`` and the ``remat_dist`` it measures sit
side by side::

    python -m benchmarks.core --json bench.json

The modules (each prints a table; ``--json PATH`` writes its figures; ``--help``
lists its options; docs/benchmarks.md holds what they measured):

=========================  ================================================================
``core``                   memory and time against ``torch.utils.checkpoint`` and no
                           checkpointing, one process, then the distributed rows
                           (``dist``) on 2 torchrun ranks
``dist``                   the distributed rows: collectives, bytes, time, rounds (TP, FSDP2)
``tp_overhead``            the 2-rank TP step, resolved: remat_dist's verified replay,
                           ``torch.utils.checkpoint`` and no checkpointing
``fsdp2_overhead``         the 1-rank FSDP2 step, resolved, against ``torch.utils.checkpoint``
``fsdp2_inplace``          that step's pieces timed in place
``fsdp2_instructions``     that step in instructions (callgrind)
``checkpoint_overhead``    one small block in a hot loop
``values``                 what ``determinism_check="values"`` costs
``transport``              one round of the agreement: a stake's gloo group, a plain gloo
                           ``all_reduce``, and the old side channel (from git history)
``scale``                  the agreement's rounds with many simulated ranks
``budget``                 the ``MemoryBudget`` sweep on 2 torchrun ranks
``compiled``               compiled blocks (``torch.compile``) with and without remat
``hf_transformers``        transformers models per architecture family
``exits``                  how 2-rank jobs end: unclean exits counted
=========================  ================================================================

Subprocesses a benchmark starts (torchrun ranks, workers) get the checkout's root
on ``PYTHONPATH`` (``_torchrun.child_env``), so they import the same
``benchmarks`` and ``remat_dist`` as the process that started them.
"""
