"""The multi-process test harness itself: results, reuse, failures, hangs, meshes."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from remat_dist.testing import (
    DistContext,
    DistributedTestError,
    DistributedTimeoutError,
    dist_context,
    distributed,
    pool_stats,
    run_distributed,
)

# -- functions run on the ranks (module level: the ranks import them by name) --


def _rank_info(tag: str = "") -> tuple[int, int, int, str]:
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads(), tag


def _pid() -> int:
    return os.getpid()


def _sum_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _assert_on_rank(bad_rank: int) -> None:
    value = dist.get_rank()
    assert value != bad_rank, f"deliberate failure on rank {value}"


def _raise_while_peer_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up before the collective")
    dist.barrier()  # rank 0 blocks here: rank 1 never arrives


def _hang() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # waits for rank 1, which sleeps
    else:
        time.sleep(120)


def _exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _unpicklable_result() -> object:
    return (lambda: None) if dist.get_rank() == 1 else 0


def _print_something() -> None:
    print(f"hello from {dist.get_rank()}")


def _skip_everywhere() -> None:
    pytest.skip("not applicable here")


def _destroy_group() -> None:
    dist.destroy_process_group()


def _context_fields() -> tuple[int, int, str, bool]:
    ctx = dist_context()
    return ctx.rank, ctx.world_size, ctx.test_name, os.path.isdir(ctx.shared_dir)


def _mesh_2d() -> tuple[tuple[int, ...], float, float]:
    mesh = dist_context().mesh
    assert mesh is not None and mesh.mesh_dim_names == ("dp", "tp")
    rank = float(dist.get_rank())
    tp_sum = torch.tensor([rank])
    dist.all_reduce(tp_sum, group=mesh.get_group("tp"))
    dp_sum = torch.tensor([rank])
    dist.all_reduce(dp_sum, group=mesh.get_group("dp"))
    return tuple(mesh.get_coordinate()), tp_sum.item(), dp_sum.item()


def _mesh_1d() -> int:
    mesh = dist_context().mesh
    assert mesh is not None and mesh.ndim == 1
    return mesh.size()


# -- run_distributed -------------------------------------------------------------


def test_results_come_back_per_rank() -> None:
    assert run_distributed(_rank_info, "x") == [(0, 2, 1, "x"), (1, 2, 1, "x")]
    assert run_distributed(_rank_info, kwargs={"tag": "k"})[1] == (1, 2, 1, "k")


def test_pool_is_reused_and_a_warm_call_is_cheap() -> None:
    pids = run_distributed(_pid)
    starts = pool_stats()[2].starts
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        assert run_distributed(_pid) == pids
        times.append(time.perf_counter() - t0)
    assert pool_stats()[2].starts == starts, "a call must not start processes"
    assert len(set(pids)) == 2 and os.getpid() not in pids
    median = statistics.median(times)
    print(f"warm trivial 2-rank call: median {median * 1e3:.2f} ms")
    assert median < 0.3


def test_collective_on_four_ranks() -> None:
    assert run_distributed(_sum_ranks, world_size=4) == [6.0] * 4
    assert [r[:2] for r in run_distributed(_rank_info, world_size=4)] == [
        (r, 4) for r in range(4)
    ]


def test_context_inside_a_function() -> None:
    out = run_distributed(_context_fields)
    assert [o[:2] for o in out] == [(0, 2), (1, 2)]
    assert all(o[3] for o in out)
    assert "test_context_inside_a_function" in out[0][2]
    with pytest.raises(RuntimeError, match="only available inside"):
        dist_context()


def test_two_dim_mesh() -> None:
    out = run_distributed(
        _mesh_2d, world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp")
    )
    # ranks [[0, 1], [2, 3]]: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}
    assert out == [((0, 0), 1.0, 2.0), ((0, 1), 1.0, 4.0),
                   ((1, 0), 5.0, 2.0), ((1, 1), 5.0, 4.0)]  # fmt: skip
    again = run_distributed(
        _mesh_2d, world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp")
    )
    assert again == out  # the cached mesh is reused


def test_one_dim_mesh() -> None:
    sizes = run_distributed(_mesh_1d, mesh_shape=(2,), mesh_dim_names=("dp",))
    assert sizes == [2, 2]


def test_bad_arguments_fail_in_the_caller() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module level"):
        run_distributed(local)
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: None)
    with pytest.raises(ValueError, match="mesh_shape"):
        run_distributed(_pid, world_size=2, mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="mesh_dim_names"):
        run_distributed(_pid, mesh_shape=(2,), mesh_dim_names=("a", "b"))


# -- failures ----------------------------------------------------------------------


def test_assertion_on_one_rank_names_that_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_assert_on_rank, 1)
    err = info.value
    assert err.failed_ranks == [1]
    assert err.still_running == []
    text = str(err)
    assert "failed on rank 1 of 2" in text
    assert "test_assertion_on_one_rank_names_that_rank" in text  # the test's id
    assert "deliberate failure on rank 1" in text
    assert "in _assert_on_rank" in text  # the remote traceback
    assert err.failures[1].short_type == "AssertionError"
    assert isinstance(err.failures[1].exception, AssertionError)
    # The pool was replaced; the next call runs on fresh ranks.
    assert run_distributed(_sum_ranks) == [1.0, 1.0]


def test_failure_while_peer_blocks_is_reported_promptly() -> None:
    before = run_distributed(_pid)
    t0 = time.perf_counter()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_while_peer_waits, timeout=30)
    elapsed = time.perf_counter() - t0
    err = info.value
    assert not isinstance(err, DistributedTimeoutError)
    assert elapsed < 10, f"took {elapsed:.1f} s: should not wait for the timeout"
    assert err.failed_ranks == [1] and err.still_running == [0]
    text = str(err)
    assert "ValueError: rank 1 gives up before the collective" in text
    assert "ranks [0] were still running" in text
    assert "_raise_while_peer_waits" in err.stacks.get(0, "")  # where rank 0 hangs
    after = run_distributed(_pid)
    assert set(after).isdisjoint(before)  # a new pool
    assert run_distributed(_sum_ranks) == [1.0, 1.0]


@pytest.mark.slow
def test_hang_is_reported_within_the_timeout() -> None:
    t0 = time.perf_counter()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang, timeout=2.0)
    elapsed = time.perf_counter() - t0
    # the hang itself never ends: any bound far above the 2 s timeout plus the
    # stack dumps tells a reported hang from one that waits, on a loaded machine too
    assert elapsed < 30
    err = info.value
    assert err.still_running == [0, 1] and err.failures == {}
    text = str(err)
    assert "timed out after 2 s" in text
    assert "ranks 0, 1 of 2 were still inside it" in text
    assert "test_hang_is_reported_within_the_timeout" in text
    # Where each rank was stuck: rank 0 in the barrier, rank 1 in its sleep.
    assert "in barrier" in err.stacks[0] and "in _hang" in err.stacks[0]
    assert "in _hang" in err.stacks[1]
    assert "--- rank 1 (still running) Python stacks ---" in text
    assert run_distributed(_sum_ranks) == [1.0, 1.0]


def test_dead_rank_process_is_reported() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank_1, timeout=20)
    assert info.value.failed_ranks == [1]
    assert "exited with code 3" in str(info.value)
    assert run_distributed(_sum_ranks) == [1.0, 1.0]


def test_unpicklable_result_names_the_rank() -> None:
    with pytest.raises(DistributedTestError, match="rank 1") as info:
        run_distributed(_unpicklable_result)
    assert info.value.failed_ranks == [1]
    assert "cannot be pickled" in str(info.value)


@pytest.mark.slow
def test_destroyed_group_gets_a_new_pool() -> None:
    starts = pool_stats()[2].starts if 2 in pool_stats() else 0
    run_distributed(_destroy_group)
    assert run_distributed(_sum_ranks) == [1.0, 1.0]
    assert pool_stats()[2].starts >= starts + 1


def test_skip_on_every_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="not applicable"):
        run_distributed(_skip_everywhere)


def test_rank_output_is_forwarded(capsys: pytest.CaptureFixture[str]) -> None:
    run_distributed(_print_something)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


# -- @distributed ------------------------------------------------------------------


@distributed(world_size=2)
def test_decorated_body_runs_on_every_rank(ctx: DistContext) -> None:
    assert isinstance(ctx, DistContext) and ctx.world_size == 2
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    assert ctx.all_gather_object(ctx.rank * 10) == [0, 10]


@distributed
def test_bare_decorator_without_context() -> None:
    assert dist.get_world_size() == 2


@pytest.mark.parametrize("scale", [1.0, 2.5])
@distributed(world_size=4, timeout=30)
def test_decorated_with_parameters_and_fixtures(
    ctx: DistContext, scale: float, tmp_path: object
) -> None:
    t = torch.tensor([scale])
    dist.all_reduce(t)
    assert t.item() == 4 * scale
    # The fixture's value was made in the pytest process and sent to each rank.
    (tmp_path / f"rank{ctx.rank}").write_text("ok")  # type: ignore[operator]
    ctx.barrier()
    assert len(list(tmp_path.iterdir())) == 4  # type: ignore[attr-defined]


@distributed(world_size=4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_decorated_two_dim_mesh(ctx: DistContext) -> None:
    assert ctx.mesh is not None
    assert ctx.mesh["tp"].size() == 2 and ctx.mesh["dp"].size() == 2


@distributed(world_size=2)
def _failing_body(ctx: DistContext) -> None:
    assert ctx.rank == 0, f"rank {ctx.rank} disagrees"


def test_decorated_failure_names_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        _failing_body()
    assert info.value.failed_ranks == [1]
    assert "rank 1 disagrees" in str(info.value)


class TestDecoratedMethods:
    @distributed(world_size=2)
    def test_method_body(self, ctx: DistContext) -> None:
        assert isinstance(self, TestDecoratedMethods)
        assert ctx.rank == dist.get_rank()


def _echo(value: object) -> object:
    return value


def test_unpicklable_argument_fails_in_the_caller_and_keeps_the_pool() -> None:
    import threading

    pids = run_distributed(_pid)
    with pytest.raises(TypeError, match="cannot be pickled"):
        run_distributed(_echo, threading.Lock())
    assert run_distributed(_pid) == pids
    tensor = torch.arange(4.0)
    assert all(torch.equal(t, tensor) for t in run_distributed(_echo, tensor))
