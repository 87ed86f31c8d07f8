"""The cost model: alpha-beta collectives, the LPT owner assignment, automatic bucket sizes (one process, no MPI)."""

import itertools
import json
import math
import random

import pytest

from hpcnet.comm.costmodel import LinkCost, OwnerAssignment, assign_shards, auto_bucket_bytes, measured_speeds

KIB, MIB = 1 << 10, 1 << 20


def unit_link(n_ranks: int) -> LinkCost:
    """A link on which the assignment's communication costs exactly 1 s per owned byte (2(n-1)/B = 1)."""
    return LinkCost(latency_s=1e-6, bandwidth_Bps=float(max(2 * (n_ranks - 1), 1)))


def optimum_bytes(sizes: list[int], n_ranks: int) -> int:
    """The smallest possible largest rank load, by trying every owner vector."""
    best = sum(sizes)
    for owners in itertools.product(range(n_ranks), repeat=len(sizes)):
        loads = [0] * n_ranks
        for size, rank in zip(sizes, owners):
            loads[rank] += size
        best = min(best, max(loads))
    return best


def naive_greedy(sizes: list[int], speeds: list[float], compute: list[float], link: LinkCost) -> list[int]:
    """LPT with every rank tried for every item (O(n m)): what the heaps must reproduce."""
    comm = 2 * (len(speeds) - 1) / link.bandwidth_Bps
    order = sorted(range(len(sizes)), key=lambda i: (-(sizes[i] * compute[i] + sizes[i] * comm), i))
    time_s, owner = [0.0] * len(speeds), [0] * len(sizes)
    for i in order:
        finish_s, rank = min((time_s[r] + sizes[i] * compute[i] / speeds[r] + sizes[i] * comm, r)
                             for r in range(len(speeds)))
        time_s[rank], owner[i] = finish_s, rank
    return owner


# --------------------------------------------------------------------------- links and collectives


def test_link_from_probe_converts_microseconds_and_gigabits():
    link = LinkCost.from_probe(latency_us=2.0, bandwidth_gbps=8.0)
    assert link.latency_s == pytest.approx(2e-6)
    assert link.bandwidth_Bps == pytest.approx(1e9)  # 8 Gbit/s = 1 GB/s


def test_ring_collectives_against_hand_computed_figures():
    link = LinkCost(latency_s=1e-5, bandwidth_Bps=1e9)
    # 4 ranks, 1 GB: all-reduce = 6 steps x 10 us + 2*3/4 of 1 GB at 1 GB/s
    assert link.all_reduce_s(10**9, 4) == pytest.approx(6e-5 + 1.5)
    assert link.reduce_scatter_s(10**9, 4) == pytest.approx(3e-5 + 0.75)
    assert link.all_gather_s(10**9, 4) == pytest.approx(3e-5 + 0.75)
    # 2 ranks, 100 bytes: latency-bound
    assert link.all_reduce_s(100, 2) == pytest.approx(2e-5 + 100e-9)
    # an all-reduce is a reduce-scatter then an all-gather
    assert link.all_reduce_s(12345, 7) == pytest.approx(link.reduce_scatter_s(12345, 7) + link.all_gather_s(12345, 7))
    for collective in (link.all_reduce_s, link.reduce_scatter_s, link.all_gather_s):
        assert collective(10**9, 1) == 0.0  # nothing to exchange
        assert collective(0, 4) > 0  # an empty message still pays the latency of every step


@pytest.mark.parametrize("kwargs, message", [
    (dict(latency_s=0.0, bandwidth_Bps=1e9), r"latency_s must be a positive finite number, got 0.0"),
    (dict(latency_s=-1e-6, bandwidth_Bps=1e9), r"latency_s must be a positive finite number, got -1e-06"),
    (dict(latency_s=1e-6, bandwidth_Bps=math.inf), r"bandwidth_Bps must be a positive finite number, got inf"),
    (dict(latency_s=1e-6, bandwidth_Bps=math.nan), r"bandwidth_Bps must be a positive finite number, got nan"),
])
def test_link_rejects_impossible_figures(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinkCost(**kwargs)


def test_link_from_probe_names_the_probe_figure():
    with pytest.raises(ValueError, match=r"latency_us must be a positive finite number, got 0"):
        LinkCost.from_probe(latency_us=0, bandwidth_gbps=10.0)
    with pytest.raises(ValueError, match=r"bandwidth_gbps must be a positive finite number, got nan"):
        LinkCost.from_probe(latency_us=5.0, bandwidth_gbps=math.nan)


def test_collective_arguments_are_checked():
    link = LinkCost(latency_s=1e-6, bandwidth_Bps=1e9)
    with pytest.raises(ValueError, match=r"nbytes must be >= 0, got -1"):
        link.all_reduce_s(-1, 4)
    with pytest.raises(ValueError, match=r"n_ranks must be >= 1, got 0"):
        link.all_gather_s(8, 0)


# --------------------------------------------------------------------------- the owner assignment


def test_lpt_finds_the_optimum_on_an_easy_case():
    sizes = [5, 4, 3, 3, 2, 2, 1]
    assignment = assign_shards(sizes, [1.0] * 3, compute_s_per_byte=1.0, link=unit_link(3))
    assert max(assignment.rank_bytes) == optimum_bytes(sizes, 3) == 7
    # 1 s/byte update + 1 s/byte communication
    assert assignment.rank_time_s == [2.0 * b for b in assignment.rank_bytes]
    assert assignment.max_time_s == 14.0
    assert sorted(i for r in range(3) for i in assignment.owned(r)) == list(range(len(sizes)))


def test_lpt_meets_its_bound_where_it_misses_the_optimum():
    # The classic case: LPT puts both 3s apart and ends with 3+2+2 = 7; 3+3 | 2+2+2 = 6 is best. 7/6 is the
    # bound 4/3 - 1/(3m) for m = 2, reached exactly.
    sizes = [3, 3, 2, 2, 2]
    assignment = assign_shards(sizes, [1.0, 1.0], compute_s_per_byte=1.0, link=unit_link(2))
    assert optimum_bytes(sizes, 2) == 6
    assert max(assignment.rank_bytes) == 7
    assert assignment.owner == [0, 1, 0, 1, 0]


def test_lpt_is_within_four_thirds_of_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 100) for _ in range(7)]
        assignment = assign_shards(sizes, [1.0] * 3, compute_s_per_byte=1.0, link=unit_link(3))
        best = optimum_bytes(sizes, 3)
        assert best <= max(assignment.rank_bytes) <= 4 / 3 * best, sizes
        assert sum(assignment.rank_bytes) == sum(sizes)
        assert assignment.rank_bytes == [sum(s for s, o in zip(sizes, assignment.owner) if o == r) for r in range(3)]


def test_the_heaps_choose_as_trying_every_rank_does():
    rng = random.Random(1)
    link = LinkCost(latency_s=1e-5, bandwidth_Bps=5e3)
    for speeds in ([1.0, 0.7, 0.7, 0.4], [0.3, 1.0, 0.3, 1.0, 0.6], [1.0] * 4):
        sizes = [rng.randint(0, 10_000) for _ in range(40)]
        compute = [rng.uniform(0, 1e-3) for _ in sizes]
        assignment = assign_shards(sizes, speeds, compute_s_per_byte=compute, link=link)
        assert assignment.owner == naive_greedy(sizes, speeds, compute, link)
    # Small integers at speeds 1 and 1/2: exact ties between ranks of different speeds, which go to the lower rank.
    speeds = [0.5, 1.0, 0.5, 1.0]
    for _ in range(20):
        sizes = [rng.randint(1, 4) for _ in range(12)]
        assignment = assign_shards(sizes, speeds, compute_s_per_byte=1.0, link=unit_link(4))
        assert assignment.owner == naive_greedy(sizes, speeds, [1.0] * len(sizes), unit_link(4)), sizes


def test_a_rank_at_half_speed_gets_half_the_bytes():
    fast_link = LinkCost(latency_s=1e-6, bandwidth_Bps=1e15)  # communication negligible: compute decides
    assignment = assign_shards([1000] * 100, [1.0, 1.0, 0.5], compute_s_per_byte=1e-9, link=fast_link)
    fast_a, fast_b, slow = assignment.rank_bytes
    assert sum(assignment.rank_bytes) == 100_000
    for fast in (fast_a, fast_b):
        assert abs(slow - fast / 2) <= 1000  # within one parameter of the ideal 40k/40k/20k
    assert assignment.imbalance == pytest.approx(1.0, abs=0.05)


def test_rank_time_is_update_over_speed_plus_communication():
    # One parameter of 100 bytes, 0.01 s/byte; ring of 2 at 10 B/s: 2*(2-1)/10 = 0.2 s per owned byte.
    # Rank 0 finishes it in 1 + 20 = 21 s, rank 1 (half speed) in 2 + 20 = 22 s.
    assignment = assign_shards([100], [1.0, 0.5], compute_s_per_byte=0.01,
                               link=LinkCost(latency_s=1.0, bandwidth_Bps=10.0))
    assert assignment.owner == [0]
    assert assignment.rank_time_s == pytest.approx([21.0, 0.0])
    assert assignment.max_time_s == pytest.approx(21.0)
    assert assignment.imbalance == pytest.approx(2.0)


def test_compute_per_parameter_orders_the_items():
    # Parameter 0 is small but costly to update (an embedding with a heavy optimizer, say): it goes first.
    link = LinkCost(latency_s=1e-6, bandwidth_Bps=1e15)
    assignment = assign_shards([10, 100, 100], [1.0, 1.0], compute_s_per_byte=[100.0, 1.0, 1.0], link=link)
    assert assignment.owner == [0, 1, 1]
    scalar = assign_shards([7, 3, 5], [1.0, 1.0], compute_s_per_byte=2.0, link=link)
    assert scalar == assign_shards([7, 3, 5], [1.0, 1.0], compute_s_per_byte=[2.0] * 3, link=link)


def test_the_assignment_is_deterministic():
    rng = random.Random(2)
    sizes = [rng.randint(1, 1 << 20) for _ in range(50)]
    link = LinkCost.from_probe(latency_us=5.0, bandwidth_gbps=100.0)
    kw = dict(compute_s_per_byte=1e-9, link=link)
    assignment = assign_shards(sizes, [1.0, 0.9, 1.0, 0.5], **kw)
    assert assignment == assign_shards(list(sizes), [1.0, 0.9, 1.0, 0.5], **kw)
    # distinct sizes, shuffled: every parameter keeps its owner
    perm = list(range(len(sizes)))
    rng.shuffle(perm)
    shuffled = assign_shards([sizes[p] for p in perm], [1.0, 0.9, 1.0, 0.5], **kw)
    assert [shuffled.owner[j] for j in sorted(range(len(perm)), key=perm.__getitem__)] == assignment.owner
    assert shuffled.rank_bytes == assignment.rank_bytes
    # equal items: ties go by index, then by rank, so the assignment is a round robin whatever the history
    equal = assign_shards([64] * 7, [1.0] * 3, **kw)
    assert equal.owner == [0, 1, 2, 0, 1, 2, 0]
    assert assign_shards([64] * 7, [1.0] * 3, **kw) == equal
    assert json.loads(json.dumps(assignment.to_json())) == assignment.to_json()
    assert set(assignment.to_json()) == {"owner", "rank_bytes", "rank_time_s", "max_time_s", "imbalance"}


def test_no_parameters_is_an_empty_balanced_assignment():
    assignment = assign_shards([], [1.0, 1.0], compute_s_per_byte=1.0, link=unit_link(2))
    assert assignment == OwnerAssignment(owner=[], rank_bytes=[0, 0], rank_time_s=[0.0, 0.0])
    assert assignment.max_time_s == 0.0 and assignment.imbalance == 1.0
    single = assign_shards([5, 3], [1.0], compute_s_per_byte=1.0, link=unit_link(1))
    assert single.owner == [0, 0] and single.rank_time_s == [8.0]  # one rank: no communication


@pytest.mark.parametrize("sizes, speeds, compute, message", [
    ([1], [], 1.0, r"rank_speeds must name at least one rank"),
    ([1], [1.0, 0.0], 1.0, r"rank_speeds\[1\] must be a positive finite number, got 0.0"),
    ([1], [-1.0], 1.0, r"rank_speeds\[0\] must be a positive finite number, got -1.0"),
    ([1], [math.nan], 1.0, r"rank_speeds\[0\] must be a positive finite number, got nan"),
    ([4, -5], [1.0], 1.0, r"sizes_bytes\[1\] must be >= 0, got -5"),
    ([4, 5, 6], [1.0], [1.0, 1.0], r"compute_s_per_byte has 2 entries for 3 parameters in sizes_bytes"),
    ([4, 5], [1.0], [-1.0, 1.0], r"compute_s_per_byte\[0\] must be a finite number >= 0, got -1.0"),
    ([4, 5], [1.0], math.inf, r"compute_s_per_byte\[0\] must be a finite number >= 0, got inf"),
])
def test_assign_shards_rejects_bad_arguments(sizes, speeds, compute, message):
    with pytest.raises(ValueError, match=message):
        assign_shards(sizes, speeds, compute_s_per_byte=compute, link=unit_link(2))


# --------------------------------------------------------------------------- automatic bucket size


def test_auto_bucket_is_where_latency_is_the_allowed_share():
    link = LinkCost.from_probe(latency_us=10.0, bandwidth_gbps=10.0)  # 10 us, 1.25 GB/s
    bucket = auto_bucket_bytes(link, total_bytes=1 << 30, n_ranks=8)
    # n alpha B (1 - f) / f = 8 * 1e-5 * 1.25e9 * 0.95 / 0.05 = 1.9e6 bytes, up to 29 x 64 KiB
    assert bucket == 29 * 64 * KIB
    latency_share = lambda b: 2 * 7 * link.latency_s / link.all_reduce_s(b, 8)  # noqa: E731
    assert latency_share(bucket) <= 0.05 < latency_share(bucket - 64 * KIB)


def test_auto_bucket_grows_with_latency_and_respects_its_bounds():
    total = 1 << 30
    low = auto_bucket_bytes(LinkCost.from_probe(2.0, 100.0), total, 8)
    high = auto_bucket_bytes(LinkCost.from_probe(50.0, 100.0), total, 8)
    assert low < high
    assert auto_bucket_bytes(LinkCost.from_probe(0.1, 1.0), total, 2) == 1 * MIB  # clamped up to min_bytes
    assert auto_bucket_bytes(LinkCost.from_probe(1000.0, 400.0), total, 64) == 64 * MIB  # clamped to max_bytes
    assert auto_bucket_bytes(LinkCost.from_probe(1000.0, 400.0), total, 64, max_bytes=8 * MIB) == 8 * MIB
    assert auto_bucket_bytes(LinkCost.from_probe(0.1, 1.0), total, 2, min_bytes=256 * KIB) == 256 * KIB
    assert auto_bucket_bytes(LinkCost.from_probe(50.0, 100.0), total, 1) == 1 * MIB  # one rank: nothing to hide
    for latency_us in (0.5, 3.0, 7.7, 40.0, 333.0):
        for n_ranks in (2, 3, 16):
            bucket = auto_bucket_bytes(LinkCost.from_probe(latency_us, 25.0), total, n_ranks)
            assert bucket % (64 * KIB) == 0 and 1 * MIB <= bucket <= 64 * MIB


def test_auto_bucket_leaves_two_buckets_to_overlap():
    slow = LinkCost.from_probe(1000.0, 400.0)  # wants the largest bucket
    assert auto_bucket_bytes(slow, 6 * MIB, 8) == 3 * MIB
    # half of the total, rounded down to 64 KiB so the rounding never makes it more than half
    total = 2 * (3 * MIB + 100_000)
    bucket = auto_bucket_bytes(slow, total, 8)
    assert bucket == (total // 2) // (64 * KIB) * (64 * KIB) and bucket <= total // 2
    # half of 1.5 MiB is under min_bytes: the rule does not apply (a bucket cannot be smaller than min_bytes)
    assert auto_bucket_bytes(slow, 3 * MIB // 2, 8) == 64 * MIB
    assert auto_bucket_bytes(slow, 2 * MIB, 8) == 1 * MIB  # half is exactly min_bytes


@pytest.mark.parametrize("kwargs, message", [
    (dict(total_bytes=-1), r"total_bytes must be >= 0, got -1"),
    (dict(n_ranks=0), r"n_ranks must be >= 1, got 0"),
    (dict(overhead_fraction=0.0), r"overhead_fraction must be in \(0, 1\), got 0.0"),
    (dict(overhead_fraction=1.0), r"overhead_fraction must be in \(0, 1\), got 1.0"),
    (dict(overhead_fraction=math.nan), r"overhead_fraction must be in \(0, 1\), got nan"),
    (dict(min_bytes=0), r"min_bytes must be a positive multiple of 65536 \(64 KiB\), got 0"),
    (dict(min_bytes=1000), r"min_bytes must be a positive multiple of 65536 \(64 KiB\), got 1000"),
    (dict(max_bytes=512 * KIB), r"max_bytes must be a multiple of 65536 \(64 KiB\) and >= min_bytes \(1048576\)"),
    (dict(max_bytes=2 * MIB + 1), r"max_bytes must be a multiple of 65536 .* got 2097153"),
])
def test_auto_bucket_rejects_bad_arguments(kwargs, message):
    args = dict(total_bytes=1 << 30, n_ranks=4) | kwargs
    with pytest.raises(ValueError, match=message):
        auto_bucket_bytes(LinkCost.from_probe(5.0, 25.0), **args)


# --------------------------------------------------------------------------- speeds


def test_measured_speeds_are_relative_to_the_fastest():
    assert measured_speeds([2.0, 1.0, 4.0]) == [0.5, 1.0, 0.25]
    assert measured_speeds([0.3]) == [1.0]
    with pytest.raises(ValueError, match=r"step_times_s must hold at least one rank's time"):
        measured_speeds([])
    with pytest.raises(ValueError, match=r"step_times_s\[1\] must be a positive finite number, got 0.0"):
        measured_speeds([1.0, 0.0])
    with pytest.raises(ValueError, match=r"step_times_s\[0\] must be a positive finite number, got inf"):
        measured_speeds([math.inf, 1.0])


def test_stage_2_buckets_are_a_quarter_of_a_shard_at_most():
    from hpcnet.comm.costmodel import stage2_bucket_cap

    mib = 1 << 20
    assert stage2_bucket_cap(112 * mib, 4) == 7 * mib  # the bench's transformer at 4 ranks
    assert stage2_bucket_cap(112 * mib, 4) % (64 << 10) == 0
    assert stage2_bucket_cap(3 * mib, 8) == mib  # never below the floor
    assert stage2_bucket_cap(1000 * mib, 2) == 125 * mib
    with pytest.raises(ValueError):
        stage2_bucket_cap(mib, 0)
    with pytest.raises(ValueError):
        stage2_bucket_cap(mib, 2, share=0)


def test_the_forecast_on_a_faked_probe_sends_each_host_its_share_once():
    """2 hosts of 2 ranks, a 1 Gbit/s link between them and 10 Gbit/s inside: the hierarchical path sends the
    40 MiB gradient out of each host once (the link's limit), the flat ring 1.5 times, bf16 half and int8 a
    quarter of it (plus its scales); on one node nothing crosses."""
    from hpcnet.comm.costmodel import forecast_allreduce

    inter, intra = LinkCost.from_probe(100.0, 1.0), LinkCost.from_probe(5.0, 10.0)
    grad = 40 << 20
    kw = dict(nodes=2, local=2, inter=inter, intra=intra)
    hier = forecast_allreduce(grad, hierarchical=True, **kw)
    flat = forecast_allreduce(grad, hierarchical=False, **kw)
    assert (hier.path, hier.wire, hier.host_bytes) == ("hierarchical", "fp32", grad)
    assert flat.host_bytes == int(1.5 * grad) and flat.seconds > hier.seconds
    assert hier.seconds == pytest.approx(grad / 125e6, rel=0.05)  # 0.34 s: the link, the intra phases hidden
    bf16 = forecast_allreduce(grad, hierarchical=True, wire="bf16", **kw)
    int8 = forecast_allreduce(grad, hierarchical=True, wire="int8", **kw)
    assert bf16.host_bytes == grad // 2 and int8.host_bytes == int(grad / 4 * (1 + 4 / 256))
    assert int8.seconds < bf16.seconds < hier.seconds
    # a slow node-local link: the intra-node phases are what the pipeline waits for
    slow_inside = forecast_allreduce(grad, hierarchical=True, nodes=2, local=2, inter=inter,
                                     intra=LinkCost.from_probe(5.0, 0.1))
    assert slow_inside.seconds > 3 * hier.seconds
    one = forecast_allreduce(grad, hierarchical=False, nodes=1, local=4, inter=inter, intra=intra)
    assert one.host_bytes == 0 and one.seconds == pytest.approx(intra.all_reduce_s(grad, 4))
    with pytest.raises(ValueError, match="wire: 'int4'"):
        forecast_allreduce(grad, hierarchical=True, wire="int4", **kw)


def test_dist_hierarchical_auto_chooses_the_path_and_chunk_the_forecast_says_is_faster():
    """On faked probes: hierarchical where each host's link is the limit (its ranks reach each other faster), at the
    chunk that pipelines best; flat where a node's ranks reach each other more slowly than the other nodes (the
    hierarchical path's inner phases would be the slow part); a high-latency link takes larger chunks."""
    from hpcnet.comm.costmodel import CHUNK_CHOICES, choose_path

    grad = 40 << 20
    slow_link = choose_path(grad, nodes=2, local=2, inter=LinkCost.from_probe(100.0, 1.0),
                            intra=LinkCost.from_probe(5.0, 10.0))
    assert slow_link.hierarchical and slow_link.chunk_bytes == CHUNK_CHOICES[0]
    assert slow_link.chosen is slow_link.nested and slow_link.flat.seconds > 1.4 * slow_link.nested.seconds
    assert "hierarchical, 4 MiB chunks (forecast" in slow_link.describe()
    slow_inside = choose_path(grad, nodes=2, local=4, inter=LinkCost.from_probe(2.0, 100.0),
                              intra=LinkCost.from_probe(50.0, 2.0))
    assert not slow_inside.hierarchical and slow_inside.chosen is slow_inside.flat
    assert slow_inside.describe().startswith("flat (forecast")
    far = choose_path(grad, nodes=2, local=2, inter=LinkCost.from_probe(500.0, 10.0),
                      intra=LinkCost.from_probe(5.0, 100.0))
    assert far.hierarchical and far.chunk_bytes == CHUNK_CHOICES[-1]  # 0.5 ms a message: fewer, larger chunks
    # Without a measured intra-node link the inner phases cost nothing in the model: hierarchical.
    assert choose_path(grad, nodes=2, local=2, inter=LinkCost.from_probe(100.0, 1.0), intra=None).hierarchical
