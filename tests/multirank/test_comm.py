"""Collectives give c10d's values and charge exactly what theory says, per rank.

Values are integer-valued floats, so every sum is exact and compared with zero tolerance.
Each world runs all its cases in one call; the parent compares the counters with theory.
"""
import pytest
import torch
import torch.distributed as dist

from meshtrain.core.comm import (Comm, ring_all_reduce_elements,
                                 ring_all_reduce_received_elements, ring_chunk_sizes,
                                 ring_half_elements)
from meshtrain.core.mesh import GROUP_AXES, Mesh, axis_groups, coordinates, rank_grid
from meshtrain.core.plan import Plan
from meshtrain.core.reference_collectives import parameter_server_all_reduce, ring_all_reduce
from meshtrain.testing import run_ranks

SIZES = (1, 5, 7, 1000, 1001)   # none divisible by 2, 3, 4 or 8 except 1000 (by 2, 4, 8)
exact = dict(rtol=0, atol=0)


def sizes_for(n: int) -> tuple[int, ...]:
    return SIZES + (12 * n,)    # and one that every N divides


def rank_data(numel: int, rank: int, dtype=torch.float64) -> torch.Tensor:
    """Rank `rank`'s integer-valued tensor: distinct per rank and per element."""
    return (torch.arange(numel, dtype=dtype) % 97) * (rank + 1) + 100 * rank


def dp_cases(sizes):
    """Every dp-only case on one world: reference algorithms and c10d collectives via Comm."""
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = Mesh.build(Plan(dp=n))
    out = {}
    for numel in sizes:
        expected = sum(rank_data(numel, k) for k in range(n))
        c10d = rank_data(numel, r)
        dist.all_reduce(c10d)
        torch.testing.assert_close(c10d, expected, **exact)
        for name, algorithm in (("ring", ring_all_reduce), ("ps", parameter_server_all_reduce)):
            comm = Comm(mesh)
            t = rank_data(numel, r)
            algorithm(comm, t, "dp")
            torch.testing.assert_close(t, c10d, **exact, msg=f"{name} numel={numel}")
            out[(name, numel)] = comm.stats.snapshot()
        comm = Comm(mesh)
        t = rank_data(numel, r)
        comm.all_reduce(t, "dp", tag="c10d")
        torch.testing.assert_close(t, c10d, **exact)
        out[("all_reduce", numel)] = comm.stats.snapshot()
    out["collectives"] = c10d_collectives(mesh)
    return out


def c10d_collectives(mesh: Mesh, k: int = 6) -> dict:
    """all_reduce (avg, max), all_gather, reduce_scatter, broadcast via Comm, in float32."""
    n, r = mesh.size("dp"), mesh.axis_rank("dp")
    comm = Comm(mesh)
    f32 = torch.float32
    t = rank_data(n * k, r, f32)
    comm.all_reduce(t, "dp", op="avg", tag="avg")
    torch.testing.assert_close(t, sum(rank_data(n * k, j, f32) for j in range(n)) / n)
    m = rank_data(n * k, r, f32)
    comm.all_reduce(m, "dp", op="max", tag="max")
    torch.testing.assert_close(m, torch.stack([rank_data(n * k, j, f32) for j in range(n)]).amax(0),
                               **exact)

    gathered = torch.empty(n * k, dtype=f32)
    comm.all_gather(gathered, rank_data(k, r, f32), "dp", tag="ag")
    torch.testing.assert_close(gathered, torch.cat([rank_data(k, j, f32) for j in range(n)]),
                               **exact)

    shard = torch.empty(k, dtype=f32)
    comm.reduce_scatter(shard, rank_data(n * k, r, f32), "dp", tag="rs")
    total = sum(rank_data(n * k, j, f32) for j in range(n))
    torch.testing.assert_close(shard, total[r * k:(r + 1) * k], **exact)

    src = n - 1
    b = torch.full((k,), float(r), dtype=f32)
    comm.broadcast(b, src=src, axis="dp", tag="bc")
    torch.testing.assert_close(b, torch.full((k,), float(src)), **exact)
    return comm.stats.snapshot()


def ring_received_elements(numel: int, n: int, rank: int) -> int:
    """Theory: reduce-scatter receives every chunk but this rank's own, all-gather every
    chunk but the one it finished with, (rank+1) % n."""
    sizes = ring_chunk_sizes(numel, n)
    return 2 * numel - sizes[rank] - sizes[(rank + 1) % n]


def check_dp_counters(results, n: int, sizes) -> None:
    esize = 8
    for numel in sizes:
        S = numel * esize
        ring_sent = [res[("ring", numel)]["dp/send[ring]"]["sent"] for res in results]
        ring_recv = [res[("ring", numel)]["dp/recv[ring]"]["received"] for res in results]
        for rank, res in enumerate(results):
            ring, ps, fast = (res[(k, numel)] for k in ("ring", "ps", "all_reduce"))
            # ring: what each rank sends and receives
            assert ring_sent[rank] == ring_all_reduce_elements(numel, n, rank) * esize
            assert ring_recv[rank] == ring_received_elements(numel, n, rank) * esize
            assert ring_all_reduce_received_elements(numel, n, rank) \
                == ring_received_elements(numel, n, rank)
            assert ring["dp/send[ring]"]["received"] == ring["dp/recv[ring]"]["sent"] == 0
            if numel % n == 0:
                assert ring_sent[rank] == ring_recv[rank] == 2 * (n - 1) * S // n
                assert ring["dp/send[ring]"]["calls"] == ring["dp/recv[ring]"]["calls"] \
                    == 2 * (n - 1)
            # parameter server: the root carries everything
            if rank == 0:
                assert ps == {"dp/recv[ps]": {"calls": n - 1, "sent": 0, "received": (n - 1) * S},
                              "dp/send[ps]": {"calls": n - 1, "sent": (n - 1) * S, "received": 0}}
            else:
                assert ps == {"dp/recv[ps]": {"calls": 1, "sent": 0, "received": S},
                              "dp/send[ps]": {"calls": 1, "sent": S, "received": 0}}
            # c10d all_reduce is charged what the reference ring moves, on every rank
            assert fast == {"dp/all_reduce[c10d]": {"calls": 1, "sent": ring_sent[rank],
                                                    "received": ring_recv[rank]}}
        # the per-rank formulas add up to the ring's total: 2(N-1) chunks' worth per phase pair
        total = sum(ring_all_reduce_elements(numel, n, k) for k in range(n))
        assert total == 2 * (n - 1) * numel
        assert sum(ring_sent) == sum(ring_recv) == 2 * (n - 1) * S


def check_collective_counters(results, n: int, k: int = 6) -> None:
    esize = 4
    for rank, res in enumerate(results):
        half = (n - 1) * k * esize   # (N-1)/N of the full n*k tensor
        c = res["collectives"]
        for op in ("avg", "max"):
            assert c[f"dp/all_reduce[{op}]"] == {
                "calls": 1, "sent": 2 * half, "received": 2 * half}
        assert c["dp/all_gather[ag]"] == {"calls": 1, "sent": half, "received": half}
        assert c["dp/reduce_scatter[rs]"] == {"calls": 1, "sent": half, "received": half}
        assert ring_half_elements(n * k, n, rank) * esize == half
        is_src = rank == n - 1
        assert c["dp/broadcast[bc]"] == {"calls": 1,
                                         "sent": (n - 1) * k * esize if is_src else 0,
                                         "received": 0 if is_src else k * esize}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dp_collectives_values_and_counters(n):
    results = run_ranks(n, dp_cases, sizes_for(n))
    check_dp_counters(results, n, sizes_for(n))
    check_collective_counters(results, n)
    if n == 4:
        check_mesh_axes(run_ranks(4, mesh_axis_cases, 1, 2, 1, 2), (1, 2, 2, 1))


def world8_cases(sizes):
    """World 8 once: the dp-only cases, then every axis of a (2, 2, 2) mesh."""
    return dp_cases(sizes), mesh_axis_cases(2, 2, 2)


def test_world_8():
    results = run_ranks(8, world8_cases, sizes_for(8), timeout=120)
    check_dp_counters([r[0] for r in results], 8, sizes_for(8))
    check_collective_counters([r[0] for r in results], 8)
    check_mesh_axes([r[1] for r in results], (2, 2, 1, 2))


def mesh_axis_cases(pp: int, dp: int, tp: int, cp: int = 1) -> dict:
    """All-reduce 2**rank along each axis, the flattened dp x cp included (the sum names
    exactly the members), and broadcast from axis rank 1 (the value names which global rank
    sent it)."""
    mesh = Mesh.build(Plan(pp=pp, dp=dp, tp=tp, cp=cp))
    comm = Comm(mesh)
    out = {"coords": dict(mesh.coords)}
    for axis in GROUP_AXES:
        t = torch.full((3,), 2.0 ** mesh.rank, dtype=torch.float64)
        comm.all_reduce(t, axis, tag="sum")
        out[axis] = t[0].item()
        if mesh.size(axis) > 1:
            b = torch.full((2,), float(mesh.rank))
            comm.broadcast(b, src=1, axis=axis, tag="bc")
            out[axis + "/bc"] = b[0].item()
    out["stats"] = comm.stats.snapshot()
    return out


def check_mesh_axes(results, shape) -> None:
    grid = rank_grid(*shape)   # (pp, dp, cp, tp)
    sizes = dict(zip(("pp", "dp", "cp", "tp"), shape), dp_cp=shape[1] * shape[2])
    for rank, res in enumerate(results):
        assert res["coords"] == coordinates(grid, rank)
        for axis in GROUP_AXES:
            (group,) = [g for g in axis_groups(grid, axis) if rank in g]
            assert res[axis] == sum(2.0 ** g for g in group), (rank, axis, group)
            n, axis_rank = sizes[axis], group.index(rank)
            key = f"{axis}/all_reduce[sum]"
            if n == 1:  # a group of one communicates nothing and is charged nothing
                assert key not in res["stats"]
                continue
            assert res[axis + "/bc"] == group[1]
            nbytes = ring_all_reduce_elements(3, n, axis_rank) * 8
            assert res["stats"][key] == {"calls": 1, "sent": nbytes,
                                         "received": ring_received_elements(3, n, axis_rank) * 8}
        # counters are kept per axis: nothing else was recorded
        expected_keys = {f"{a}/{op}" for a in GROUP_AXES if sizes[a] > 1
                         for op in ("all_reduce[sum]", "broadcast[bc]")}
        assert set(res["stats"]) == expected_keys


def gather_reports():
    """Each rank reports a JSON object of its own length; every rank gets all of them."""
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(Mesh.build(Plan(dp=n)))
    report = {"rank": r, "values": list(range(r * 3)), "name": "é" * r}
    return comm.gather_objects(report, tag="report"), comm.stats.snapshot()


def test_gather_objects_moves_json_and_charges_two_ring_all_gathers():
    n = 3
    expected = [{"rank": r, "values": list(range(r * 3)), "name": "é" * r} for r in range(n)]
    longest = max(len(__import__("json").dumps(e).encode()) for e in expected)
    for rank, (reports, stats) in enumerate(run_ranks(n, gather_reports)):
        assert reports == expected
        sizes_bytes = ring_half_elements(n, n, rank) * 8
        text_bytes = ring_half_elements(n * longest, n, rank)
        assert stats == {"world/all_gather[report]": {
            "calls": 2, "sent": sizes_bytes + text_bytes, "received": sizes_bytes + text_bytes}}


def link_case():
    """One all-reduce and one all-gather through a Comm on an emulated dp link, fake sleep."""
    from meshtrain.core.link import LinkModel
    n = dist.get_world_size()
    comm = Comm(Mesh.build(Plan(dp=n)))
    slept = []
    comm.link = LinkModel.from_spec("dp=1Gb/s,5ms", sleep=slept.append)
    comm.all_reduce(rank_data(1000, dist.get_rank(), torch.float32), "dp")
    comm.all_gather(torch.zeros(12 * n), torch.ones(12), "dp")
    return slept, comm.stats.snapshot()


def test_emulated_link_sleeps_the_modelled_time_of_each_call():
    n = 4
    for r, (slept, _) in enumerate(run_ranks(n, link_case)):
        ar = ring_all_reduce_elements(1000, n, r) * 4
        ar_in = ring_all_reduce_received_elements(1000, n, r) * 4
        ag = ring_half_elements(12 * n, n, r) * 4
        assert slept == pytest.approx([2 * (n - 1) * 0.005 + max(ar, ar_in) / 1.25e8,
                                       (n - 1) * 0.005 + ag / 1.25e8])


def not_freed_here(comm: Comm, k: int = 2**16, times: int = 20) -> int:
    """Bytes this thread saw allocated and not freed over `times` reduce-scatters of a fresh
    input, each waited and dropped: what a profiler of this thread (verify's allocated peak)
    would count as still live. gloo's thread drops its finished work whenever it does; the
    input and received copy it holds are emptied once summed, so their frees land here."""
    from torch.profiler import ProfilerActivity, profile

    out = torch.empty(k)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(times):
            comm.reduce_scatter(out, torch.ones(2 * k), "dp", async_op=True).wait()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def staging_cases(k: int = 1000) -> dict:
    """gloo's staging buffers, counted: an all-gather's repeated input (the output's size),
    a reduce-scatter's received copy (the input's size), two at once when both are in
    flight, none left once waited; a reduce-scatter's buffers freed on the caller's thread
    (`not_freed_here`: several MB before they were)."""
    comm = Comm(Mesh.build(Plan(dp=dist.get_world_size())))
    n = dist.get_world_size()
    shard = torch.ones(k, dtype=torch.float32)
    gathered, scattered = torch.empty(n * k), torch.empty(k)
    first = comm.all_gather(gathered, shard, "dp", async_op=True)
    second = comm.reduce_scatter(scattered, torch.ones(n * k), "dp", async_op=True)
    during = comm.staging.now
    first.wait()
    second.wait()
    return {"during": during, "after": comm.staging.now, "peak": comm.staging.peak,
            "not_freed_here": not_freed_here(comm)}


def test_staging_buffers_are_counted_while_in_flight():
    for result in run_ranks(2, staging_cases):
        assert result == {"during": 2 * (2 * 1000 * 4), "after": 0, "peak": 2 * 2 * 1000 * 4,
                          "not_freed_here": 0}
