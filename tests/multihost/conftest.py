"""The ``sim_hosts`` fixture: ``sim_hosts(n)`` makes ``n`` simulated hosts
(``tests.multihost._netns``) and tears them down after the test, whatever it
did; where they cannot be made (not root, no ``ip``, namespaces refused) the test
is skipped, saying why."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.multihost._netns import SimHosts, Unavailable, unavailable


@pytest.fixture
def sim_hosts() -> Iterator[Callable[[int], SimHosts]]:
    made: list[SimHosts] = []

    def make(n: int) -> SimHosts:
        why = unavailable()
        if why:
            pytest.skip(f"simulated hosts unavailable: {why}")
        hosts = SimHosts(n)
        made.append(hosts)  # closed below even if create() fails half-way
        try:
            hosts.create()
        except Unavailable as exc:
            pytest.skip(f"simulated hosts unavailable: {exc}")
        return hosts

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
