"""Multi-host tests on simulated hosts (network namespaces on one machine).

``_netns`` makes the hosts, ``_launch`` starts ranks or torchrun agents on them,
``_worker`` is what each rank runs; ``test_multihost`` holds the layouts (slow
tier), ``test_netns`` the hosts themselves. Needs root, ``ip``, ``unshare``,
``hostname`` and ``mount``; skipped with the reason otherwise. Run them with
``python -m pytest -n 0 -m slow tests/multihost``.
"""
