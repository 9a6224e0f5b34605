"""Layouts across simulated hosts: each host a network namespace with its own
interface (``rd0``, 10.77.x.K+1), loopback, ports, host name (``nodeK``) and hosts
file (its own name -> 127.0.1.1, the others' -> their addresses), as on
Debian/Ubuntu cluster nodes. One process per rank (or one torchrun agent per
host) with real gloo; each rank compares remat against the same model without
remat in its own process, bitwise, and reports to the test (``_worker``).

What a cluster user sets, the ranks get: ``MASTER_ADDR`` as an address or as a
node name, and ``GLOO_SOCKET_IFNAME=rd0`` -- without it torch's own gloo binds to
what the host name resolves to (127.0.1.1) and ``init_process_group`` fails
across hosts ("Connection refused, remote=[127.0.1.1]"), with or without
remat_dist.

Address forms (``master``): ``"ip"`` = host 0's address; ``"name"`` = host 0's
node name, which resolves to 127.0.1.1 on host 0 itself and to its address
elsewhere (what torchrun's c10d rendezvous hands its workers).

The tier: ``slow`` (subprocesses; root and ``ip netns`` needed, else skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.multihost._launch import Outcome, run_ranks, run_torchrun
from tests.multihost._netns import SimHosts

pytestmark = pytest.mark.slow

MASTERS = ["ip", "name"]
TIMEOUT_S = 60.0
"""Wall bound of one launch; every process left then is killed."""
DIVERGENCE_BOUND_S = 5.0
"""The replay timeout of the divergence tests: every rank raises within it."""


def _master(hosts: SimHosts, form: str) -> str:
    return hosts[0].addr if form == "ip" else hosts[0].name


def _finished(
    outcome: Outcome,
    hosts: SimHosts,
    placement: Sequence[int] | None,
    key: str | None = None,
) -> None:
    """Every rank reported, finished, and ran where it was placed. First, where
    the scenario says so (``result[key]["completed"]``): the run without remat
    finished on every rank, i.e. torch's own collectives worked across the
    hosts, so a failure after that is remat_dist's."""
    assert not outcome.missing() and not outcome.timed_out, outcome.describe()
    for rep in outcome.reports.values():
        result = rep.get("result", {})
        result = result.get(key, {}) if key else result
        if "completed" in result or key:
            assert "none" in result.get("completed", ()), (
                "the run without remat did not finish:\n" + outcome.describe()
            )
    assert all(rep["finished"] for rep in outcome.reports.values()), outcome.describe()
    if placement is not None:
        where = {r: rep["hostname"] for r, rep in outcome.reports.items()}
        assert where == {r: hosts[k].name for r, k in enumerate(placement)}, where


def _bitwise(result: dict[str, Any], what: str) -> None:
    assert result["n_grads"] > 0, (what, result)
    assert result["loss_equal"], (what, result["losses"])
    assert result["grad_mismatches"] == [], (what, result["grad_mismatches"])


def _replayed(result: dict[str, Any], what: str) -> None:
    """The remat run's backwards issued more collectives than the plain run's:
    replays re-issued the forward's collectives (on a group across hosts)."""
    counts = result["backward_collectives"]
    assert sum(counts["remat"].values()) > sum(counts["none"].values()), (what, counts)


def _hosts_of(ranks: Sequence[int], placement: Sequence[int]) -> set[int]:
    return {placement[r] for r in ranks}


# -- TP across two hosts --------------------------------------------------------------


@pytest.mark.parametrize("master", MASTERS)
def test_tp_across_two_hosts_bitwise(sim_hosts, tmp_path: Path, master: str):
    """TP=2, one rank per host: the TP group, and so the stake the replays are
    agreed on, spans the hosts. ``apply_remat(policy="full")`` + ``shard_model``
    with the reference TP plan; two SGD steps; losses and every gradient equal
    the run without remat, bitwise, on both ranks."""
    hosts = sim_hosts(2)
    placement = [0, 1]
    outcome = run_ranks(
        hosts, "tp", placement, master=_master(hosts, master),
        out_dir=tmp_path, timeout=TIMEOUT_S,
    )  # fmt: skip
    _finished(outcome, hosts, placement)
    for r, rep in outcome.reports.items():
        res = rep["result"]
        _bitwise(res, f"rank {r}")
        _replayed(res, f"rank {r}")
        assert res["stats"]["agreements"] > 0, res["stats"]  # the stake was agreed on
    losses = {tuple(rep["result"]["losses"]) for rep in outcome.reports.values()}
    assert len(losses) == 1, losses  # TP ranks compute the same loss


# -- MoE all_to_all across hosts ----------------------------------------------------


@pytest.mark.parametrize("master", MASTERS)
def test_moe_all_to_all_across_hosts_bitwise(sim_hosts, tmp_path: Path, master: str):
    """Expert parallelism, one expert per rank, one rank per host: each
    checkpointed MoE layer exchanges token counts and then the tokens (uneven
    splits) with ``dist.all_to_all_single`` on a group spanning both hosts, and
    its replay re-issues them. Bitwise equal to no remat."""
    hosts = sim_hosts(2)
    placement = [0, 1]
    outcome = run_ranks(
        hosts, "moe", placement, master=_master(hosts, master),
        out_dir=tmp_path, timeout=TIMEOUT_S,
    )  # fmt: skip
    _finished(outcome, hosts, placement)
    sent_across = 0
    for r, rep in outcome.reports.items():
        res = rep["result"]
        _bitwise(res, f"rank {r}")
        _replayed(res, f"rank {r}")
        assert "alltoall_base_" in res["backward_collectives"]["remat"], res
        sent_across += res["tokens_per_expert"][1 - r]
    assert sent_across > 0  # tokens really travel between the hosts


# -- PP x TP ------------------------------------------------------------------------

PP_LAYOUTS = {
    # name: (host of each rank, the ("pp", "tp") mesh of ranks)
    # TP groups [0, 1] and [2, 3] each span both hosts (the stakes are across
    # hosts); each pipeline hop (0 -> 2, 1 -> 3) stays within a host.
    "tp_across_hosts": ([0, 1, 0, 1], [[0, 1], [2, 3]]),
    # stage 0 on host 0, stage 1 on host 1: every pipeline hop crosses hosts,
    # each stage's TP group (its stake) stays within its host.
    "stages_on_two_hosts": ([0, 0, 1, 1], [[0, 1], [2, 3]]),
}


@pytest.mark.parametrize(
    "layout,master",
    [
        ("tp_across_hosts", "ip"),
        ("tp_across_hosts", "name"),
        ("stages_on_two_hosts", "name"),
    ],
)
def test_pp_x_tp_across_hosts_bitwise(
    sim_hosts, tmp_path: Path, layout: str, master: str
):
    """2 stages x TP 2 on 2 hosts x 2 ranks, ``Schedule1F1B`` with 4
    micro-batches, stage 0 recomputing everything and stage 1 keeping its
    attention: losses and gradients bitwise equal to no remat on every rank."""
    hosts = sim_hosts(2)
    placement, mesh_ranks = PP_LAYOUTS[layout]
    outcome = run_ranks(
        hosts, "pp_tp", placement, master=_master(hosts, master), out_dir=tmp_path,
        opts={"mesh_ranks": mesh_ranks}, timeout=TIMEOUT_S,
    )  # fmt: skip
    _finished(outcome, hosts, placement)
    for r, rep in outcome.reports.items():
        res = rep["result"]
        _bitwise(res, f"rank {r}")
        assert res["stats"]["agreements"] > 0, res["stats"]
        tp_hosts = _hosts_of(res["tp_group"], placement)
        pp_hosts = _hosts_of(res["pp_group"], placement)
        if layout == "tp_across_hosts":
            assert (len(tp_hosts), len(pp_hosts)) == (2, 1), res
        else:
            assert (len(tp_hosts), len(pp_hosts)) == (1, 2), res
        if res["stage"] == 0:  # recomputes everything: replays re-issue collectives
            _replayed(res, f"rank {r}")
        else:  # the last stage computes the loss
            assert len(res["losses"]) == 2 and all(
                len(x) == 4 for x in res["losses"]
            ), res


# -- HSDP ---------------------------------------------------------------------------


def test_hsdp_replicate_across_hosts_bitwise(sim_hosts, tmp_path: Path):
    """HSDP on 2 hosts x 2 ranks (``shard_model`` with a 2-D mesh
    ("replicate", "shard")): replicate across the hosts, shard within each. Each
    rank its own batch. Remat inside FSDP2's units re-issues no collective, so
    nothing is at stake and no agreement runs; the gradients (all-reduced across
    the hosts) are bitwise those without remat."""
    hosts = sim_hosts(2)
    placement = [0, 0, 1, 1]
    outcome = run_ranks(
        hosts, "hsdp", placement, master=_master(hosts, "name"), out_dir=tmp_path,
        opts={"mesh": [2, 2]}, timeout=TIMEOUT_S,
    )  # fmt: skip
    _finished(outcome, hosts, placement)
    for r, rep in outcome.reports.items():
        res = rep["result"]
        _bitwise(res, f"rank {r}")
        assert len(_hosts_of(res["replicate_group"], placement)) == 2, res
        assert len(_hosts_of(res["shard_group"], placement)) == 1, res
        counts = res["backward_collectives"]
        assert counts["remat"] == counts["none"], counts  # remat adds no all-gather
        assert counts["none"].get("allreduce_", 0) > 0, counts  # HSDP's replicas sync
        assert res["stats"]["agreements"] == 0 and res["stats"]["groups"] == 0, res


# -- a divergence in a cross-host stake ---------------------------------------------

DIVERGENCES = {
    # kind: (error type, what its text must say)
    "plan": ("PlanMismatchError", ["layers.0::attention", "ranks [1]"]),
    "replay_raises": (
        "CollectiveReplayError",
        [
            "ranks [1]",
            "checkpoint 'layers.1'",
            "ValueError: injected replay failure on rank 1",
        ],
    ),
    # a set-up failure is its own error, with gloo's words and the fix
    "unreachable": (
        "AgreementSetupError",
        ["could not start", "interface rdx0 (GLOO_SOCKET_IFNAME)", "GLOO_SOCKET_IFNAME to"],
    ),
}


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("kind", list(DIVERGENCES))
def test_divergence_in_tp_across_hosts(
    sim_hosts, tmp_path: Path, kind: str, master: str
):
    """TP across the two hosts; rank 1 diverges (``plan``: it keeps its blocks'
    attention while rank 0 recomputes everything; ``replay_raises``: its replay
    of block 1 raises). Every rank raises the documented error, the same text,
    within the bound; then a clean step on fresh models is bitwise on both."""
    hosts = sim_hosts(2)
    placement = [0, 1]
    error, phrases = DIVERGENCES[kind]
    outcome = run_ranks(
        hosts, "tp_divergence", placement, master=_master(hosts, master), out_dir=tmp_path,
        opts={"kind": kind, "replay_timeout": DIVERGENCE_BOUND_S}, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert not outcome.missing() and not outcome.timed_out, outcome.describe()
    # the divergent step first (a failure of the clean step after it is next)
    texts = set()
    for r, rep in outcome.reports.items():
        div = rep.get("result", {}).get("divergence")
        assert div is not None, outcome.describe()
        assert div["type"] == error and div["documented"], (r, div)
        for phrase in phrases:
            assert phrase in div["text"], (r, phrase, div["text"])
        assert div["seconds"] < DIVERGENCE_BOUND_S + 2, (r, div)
        texts.add(div["text"].replace(f"rank {r}: ", "rank r: ", 1))
    assert len(texts) == 1, texts  # every rank says the same
    _finished(outcome, hosts, placement, key="clean")
    for r, rep in outcome.reports.items():
        _bitwise(rep["result"]["clean"], f"rank {r}, the clean step after")


# -- under torchrun: one agent per host ---------------------------------------------


@pytest.mark.parametrize("endpoint", ["name", "ip_and_local_addr"])
def test_tp_across_hosts_under_torchrun(sim_hosts, tmp_path: Path, endpoint: str):
    """Two torchrun agents, one per host, ``--rdzv-backend c10d --nnodes 2
    --nproc-per-node 1``, TP=2 across them. ``name``: the rendezvous endpoint is
    ``node0:29400`` and the agents hand their workers ``MASTER_ADDR`` = the host
    name of the rendezvous' rank 0 (its ``getfqdn()``: a node name, 127.0.1.1 on
    its own host). ``ip_and_local_addr``: the endpoint is host 0's address
    (``is_host`` tells which agent serves it) and each agent is given
    ``--local-addr`` <its address>, so the workers get an address instead."""
    hosts = sim_hosts(2)
    by_name = endpoint == "name"
    outcome = run_torchrun(
        hosts, "tp", endpoint=hosts[0].name if by_name else hosts[0].addr,
        out_dir=tmp_path, timeout=TIMEOUT_S, local_addr=not by_name,
    )  # fmt: skip
    _finished(outcome, hosts, None)
    reps = outcome.reports
    assert {rep["hostname"] for rep in reps.values()} == {"node0", "node1"}, reps
    masters = {rep["master_addr"] for rep in reps.values()}
    expected = (
        {h.name for h in hosts.hosts} if by_name else {h.addr for h in hosts.hosts}
    )
    assert len(masters) == 1 and masters <= expected, masters
    for r, rep in reps.items():
        _bitwise(rep["result"], f"rank {r}")
        _replayed(rep["result"], f"rank {r}")
    assert all(code == 0 for code in outcome.returncodes.values()), outcome.describe()
