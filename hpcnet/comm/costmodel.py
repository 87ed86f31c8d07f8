"""The cost model for sharded training and automatic bucket sizes (pure logic).

Links follow the alpha-beta model: sending ``b`` bytes costs
``latency_s + b / bandwidth_Bps``.  Collectives are rings with the
nccl-tests conventions: an all-reduce over ``n`` ranks takes ``2(n-1)``
steps and puts ``2(n-1)/n`` of the buffer on every link, a reduce-scatter or
an all-gather ``n-1`` steps and ``(n-1)/n`` of it.

``assign_shards`` gives every parameter an owner rank (ZeRO-style sharding
of optimizer state and gradients) with the LPT greedy: the dynamic sharding
of the seed article and the partitioning of torch's
ZeroRedundancyOptimizer are the same family.  Every rank computes the
assignment from the same inputs and gets the same one: no communication decides it.
"""

import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Any

BUCKET_GRANULE_BYTES = 64 << 10  # bucket sizes are multiples of this: whole pages, aligned chunks on the wire


def _check_positive(name: str, value: float) -> None:
    # `not value > 0` also catches NaN, which compares false with everything.
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkCost:
    """One link in the alpha-beta model.

    Args:
        latency_s: the fixed cost of one message (alpha), seconds.
        bandwidth_Bps: the rate of its bytes (1/beta), bytes per second.
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        _check_positive("latency_s", self.latency_s)
        _check_positive("bandwidth_Bps", self.bandwidth_Bps)

    @classmethod
    def from_probe(cls, latency_us: float, bandwidth_gbps: float) -> "LinkCost":
        """The link from the topology probe's figures (``recommend``'s ``*_latency_us``, ``*_bandwidth_gbps``).

        Args:
            latency_us: one-way latency of a small message, microseconds.
            bandwidth_gbps: bandwidth in Gbit/s (1e9 bit/s, as the probe reports it).
        """
        # Checked here too, so the message names the figure the caller passed, not the converted one.
        _check_positive("latency_us", latency_us)
        _check_positive("bandwidth_gbps", bandwidth_gbps)
        return cls(latency_s=latency_us * 1e-6, bandwidth_Bps=bandwidth_gbps * 1e9 / 8)

    def _ring_s(self, nbytes: int, n_ranks: int, passes: int) -> float:
        """``passes`` trips around a ring of ``n_ranks``: each has n-1 steps moving 1/n of ``nbytes``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if n_ranks < 1:
            raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
        steps = passes * (n_ranks - 1)  # one rank: no step, no cost
        return steps * self.latency_s + steps * nbytes / (n_ranks * self.bandwidth_Bps)

    def all_reduce_s(self, nbytes: int, n_ranks: int) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` (reduce-scatter then all-gather)."""
        return self._ring_s(nbytes, n_ranks, passes=2)

    def reduce_scatter_s(self, nbytes: int, n_ranks: int) -> float:
        """Seconds for a ring reduce-scatter of an ``nbytes`` buffer (every rank keeps 1/n)."""
        return self._ring_s(nbytes, n_ranks, passes=1)

    def all_gather_s(self, nbytes: int, n_ranks: int) -> float:
        """Seconds for a ring all-gather into an ``nbytes`` buffer (every rank gives 1/n)."""
        return self._ring_s(nbytes, n_ranks, passes=1)


@dataclass(frozen=True, slots=True)
class OwnerAssignment:
    """Who owns which unit.

    Args:
        owner: the owner rank of each unit (a parameter or rows of one), by unit index.
        rank_bytes: the bytes each rank owns.
        rank_time_s: each rank's modelled time per step for what it owns (update and communication).
    """

    owner: list[int]
    rank_bytes: list[int]
    rank_time_s: list[float]

    @property
    def max_time_s(self) -> float:
        """The makespan: the slowest rank's time, which every rank waits for."""
        return max(self.rank_time_s)

    @property
    def imbalance(self) -> float:
        """Slowest over mean rank time: 1.0 is perfect balance (and what an empty assignment reports)."""
        mean_s = sum(self.rank_time_s) / len(self.rank_time_s)
        return self.max_time_s / mean_s if mean_s > 0 else 1.0

    def owned(self, rank: int) -> list[int]:
        """The parameter indices ``rank`` owns, ascending."""
        return [index for index, owner in enumerate(self.owner) if owner == rank]

    def to_json(self) -> dict[str, Any]:
        """A plain dict for owners.json."""
        return {"owner": list(self.owner), "rank_bytes": list(self.rank_bytes),
                "rank_time_s": list(self.rank_time_s), "max_time_s": self.max_time_s,
                "imbalance": self.imbalance}


def assign_shards(sizes_bytes: list[int], rank_speeds: list[float], *, compute_s_per_byte: list[float] | float,
                  link: LinkCost) -> OwnerAssignment:
    """Give every unit (a parameter, or rows of a cut one: ``hpcnet.comm.sharding.layout.split_units``) an owner
    rank so that the slowest rank finishes early.

    A rank's time is the update of what it owns, ``bytes * compute_s_per_byte / speed``, plus its
    communication: gradients reduce-scattered and parameters all-gathered over a ring of shards padded to
    the largest (as ZeroRedundancyOptimizer and FSDP do), so each of the 2(n-1) steps carries one shard and
    a rank owning ``b`` bytes keeps the ring busy ``2(n-1) b / bandwidth_Bps``.  The latency terms are the
    same for every rank, so they change no decision and are left out.

    The greedy is LPT: parameters by cost, largest first (ties: lower index first), each to the rank that
    would finish it earliest (ties: lower rank).  With equal speeds its makespan is within 4/3 of the
    optimum.  O(n log n + n log m) with one heap per distinct speed.

    Args:
        sizes_bytes: each unit's size in bytes.
        rank_speeds: each rank's relative speed (``measured_speeds``; 1.0 = the fastest).
        compute_s_per_byte: update time per byte at speed 1.0, per parameter or one for all.
        link: the link the collectives run over (the slowest: inter-node when there are nodes).

    Returns:
        The assignment; identical on every rank given identical inputs.
    """
    if not rank_speeds:
        raise ValueError("rank_speeds must name at least one rank")
    for rank, speed in enumerate(rank_speeds):
        _check_positive(f"rank_speeds[{rank}]", speed)
    for index, size in enumerate(sizes_bytes):
        if size < 0:
            raise ValueError(f"sizes_bytes[{index}] must be >= 0, got {size}")
    if isinstance(compute_s_per_byte, numbers.Real):  # numpy scalars too
        compute_s_per_byte = [compute_s_per_byte] * len(sizes_bytes)
    if len(compute_s_per_byte) != len(sizes_bytes):
        raise ValueError(f"compute_s_per_byte has {len(compute_s_per_byte)} entries for "
                         f"{len(sizes_bytes)} parameters in sizes_bytes")
    for index, rate in enumerate(compute_s_per_byte):
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"compute_s_per_byte[{index}] must be a finite number >= 0, got {rate!r}")

    n_ranks = len(rank_speeds)
    comm_s_per_byte = 2 * (n_ranks - 1) / link.bandwidth_Bps
    compute_s = [size * rate for size, rate in zip(sizes_bytes, compute_s_per_byte)]
    # The cost at speed 1.0 orders the items; the index breaks ties, so equal items go in the same order on
    # every rank whatever else differs.
    order = sorted(range(len(sizes_bytes)), key=lambda i: (-(compute_s[i] + sizes_bytes[i] * comm_s_per_byte), i))

    # Ranks of one speed take an item equally fast, so the one with the least time (then the lowest rank)
    # is their best: one heap per speed, and only the heads compete.  Equal speeds: a single heap.
    heaps: dict[float, list[tuple[float, int]]] = {}
    for rank, speed in enumerate(rank_speeds):
        heaps.setdefault(speed, []).append((0.0, rank))  # ascending ranks: already a heap
    owner = [0] * len(sizes_bytes)
    rank_bytes = [0] * n_ranks
    rank_time_s = [0.0] * n_ranks
    for index in order:
        best: tuple[float, int, float] | None = None
        for speed, heap in heaps.items():
            time_s, rank = heap[0]
            finish_s = time_s + compute_s[index] / speed + sizes_bytes[index] * comm_s_per_byte
            if best is None or (finish_s, rank) < best[:2]:
                best = (finish_s, rank, speed)
        assert best is not None  # rank_speeds is not empty
        finish_s, rank, speed = best
        heapq.heapreplace(heaps[speed], (finish_s, rank))
        owner[index] = rank
        rank_bytes[rank] += sizes_bytes[index]
        rank_time_s[rank] = finish_s
    return OwnerAssignment(owner=owner, rank_bytes=rank_bytes, rank_time_s=rank_time_s)


def assignment_times_s(sizes_bytes: list[int], owner: list[int], rank_speeds: list[float], *,
                       compute_s_per_byte: float, link: LinkCost) -> list[float]:
    """Each rank's modelled time for an assignment ``owner`` at ``rank_speeds``, by ``assign_shards``'s model: to
    compare the assignment in force with a new one when measured speeds have drifted."""
    if len(owner) != len(sizes_bytes):
        raise ValueError(f"owner names {len(owner)} parameters, sizes_bytes {len(sizes_bytes)}")
    for rank, speed in enumerate(rank_speeds):
        _check_positive(f"rank_speeds[{rank}]", speed)
    comm_s_per_byte = 2 * (len(rank_speeds) - 1) / link.bandwidth_Bps
    times = [0.0] * len(rank_speeds)
    for size, rank in zip(sizes_bytes, owner):
        times[rank] += size * compute_s_per_byte / rank_speeds[rank] + size * comm_s_per_byte
    return times


STAGE2_BUCKET_SHARE = 0.25
"""dist.zero=2: a bucket is at most this share of a rank's gradient shard (``stage2_bucket_cap``)."""
STAGE3_BUCKET_SHARE = 1 / 16
"""dist.zero=3: ... and at stage 3 this share, where the buckets in flight weigh more beside a rank's share of
everything: on a 71 M-parameter transformer at 4 ranks, buckets of 4 MiB instead of 17.8 lowered the peak by 35 to
42 MiB (of about 475) at the same step time (benchmarks/2026-12-07-memory-zero3.md)."""


def bucket_share(stage: int) -> float:
    """The share of a rank's gradient shard a bucket may hold at ``dist.zero`` ``stage`` (2 or 3)."""
    return STAGE3_BUCKET_SHARE if stage == 3 else STAGE2_BUCKET_SHARE


def stage2_bucket_cap(total_bytes: int, n_ranks: int, *, share: float = STAGE2_BUCKET_SHARE,
                      min_bytes: int = 1 << 20) -> int:
    """The largest gradient bucket at ``dist.zero=2`` (and with ``share=STAGE3_BUCKET_SHARE`` at 3): ``share`` of
    the ``total_bytes / n_ranks`` a rank keeps, rounded down to 64 KiB, at least ``min_bytes``.

    At stage 2 a rank holds its own gradient shard between steps, and during backward the buckets being filled
    and in flight, each with the transport's scratch of its size (Open MPI's reduce-scatter: about one bucket):
    buckets of DDP's 25 MiB would add more than the shard itself for models of a few hundred MiB (see
    benchmarks/README.md).
    """
    if total_bytes < 0 or n_ranks < 1:
        raise ValueError(f"need total_bytes >= 0 and n_ranks >= 1, got {total_bytes}, {n_ranks}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    cap = int(total_bytes / n_ranks * share) // BUCKET_GRANULE_BYTES * BUCKET_GRANULE_BYTES
    return max(min_bytes, cap)


def auto_bucket_bytes(link: LinkCost, total_bytes: int, n_ranks: int, *, overhead_fraction: float = 0.05,
                      min_bytes: int = 1 << 20, max_bytes: int = 64 << 20) -> int:
    """The gradient bucket size for ``dist.bucket_mb = "auto"``.

    A ring all-reduce of ``b`` bytes takes ``T = 2(n-1) alpha + 2(n-1)/n * b / B``.  Its latency share
    ``2(n-1) alpha / T`` is at most ``f`` when ``b >= n * alpha * B * (1 - f) / f``: the smallest such
    bucket, so that buckets stay small enough to overlap with backward.  Then, in order: clamped to
    [``min_bytes``, ``max_bytes``]; at most half of ``total_bytes`` (rounded down to 64 KiB) when that half
    is at least ``min_bytes``, so at least two buckets exist to overlap with backward; rounded up to a
    multiple of 64 KiB.  One rank communicates nothing: ``min_bytes``.

    Args:
        link: the link the all-reduce runs over.
        total_bytes: the bytes of all gradients.
        n_ranks: ranks in the all-reduce.
        overhead_fraction: the largest share of a bucket's time allowed for latency, in (0, 1).
        min_bytes: smallest bucket; a positive multiple of 64 KiB.
        max_bytes: largest bucket; a multiple of 64 KiB, at least ``min_bytes``.

    Returns:
        The bucket size in bytes, a multiple of 64 KiB.
    """
    if total_bytes < 0:
        raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if not 0 < overhead_fraction < 1:
        raise ValueError(f"overhead_fraction must be in (0, 1), got {overhead_fraction!r}")
    # Multiples of the granule, so rounding up inside the bounds never passes one.
    if min_bytes <= 0 or min_bytes % BUCKET_GRANULE_BYTES:
        raise ValueError(f"min_bytes must be a positive multiple of {BUCKET_GRANULE_BYTES} (64 KiB), got {min_bytes}")
    if max_bytes < min_bytes or max_bytes % BUCKET_GRANULE_BYTES:
        raise ValueError(f"max_bytes must be a multiple of {BUCKET_GRANULE_BYTES} (64 KiB) and >= min_bytes "
                         f"({min_bytes}), got {max_bytes}")
    if n_ranks == 1:
        return min_bytes
    f = overhead_fraction
    target_bytes = math.ceil(n_ranks * link.latency_s * link.bandwidth_Bps * (1 - f) / f)
    upper_bytes = max_bytes
    half_bytes = total_bytes // 2 // BUCKET_GRANULE_BYTES * BUCKET_GRANULE_BYTES
    if half_bytes >= min_bytes:
        upper_bytes = min(upper_bytes, half_bytes)
    bucket_bytes = min(max(target_bytes, min_bytes), upper_bytes)
    return -(-bucket_bytes // BUCKET_GRANULE_BYTES) * BUCKET_GRANULE_BYTES


WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0 + 4 / 256}
"""Bytes an element crosses the nodes in, by ``dist.compression`` (int8: one float32 scale a block of 256,
``hpcnet.comm.quantize``)."""


@dataclass(frozen=True, slots=True)
class CommForecast:
    """The alpha-beta model's figures for summing a step's gradients once (``forecast_allreduce``)."""

    path: str
    """'hierarchical' or 'flat'."""
    wire: str
    """What crosses the nodes: a key of ``WIRE_BYTES``."""
    host_bytes: int
    """Bytes each host sends over its inter-node link (0 on one node)."""
    seconds: float
    """Predicted time of the all-reduce of the whole gradient (not what backward hides of it)."""


def forecast_allreduce(gradient_bytes: int, *, nodes: int, local: int, hierarchical: bool, inter: LinkCost,
                       intra: LinkCost | None = None, wire: str = "fp32", chunk_bytes: int = 4 << 20
                       ) -> CommForecast:
    """Predict one step's gradient all-reduce on ``nodes`` nodes of ``local`` ranks (pure).

    Flat: one ring over every rank, laid out node by node, so each node's one ring edge to the next node carries
    ``2 (P-1)/P`` of the gradient (P ranks), at the inter-node link's bandwidth, with ``2 (P-1)`` latencies.
    Hierarchical (``HierarchicalTransport``): the intra-node reduce-scatter and all-gather on ``intra`` (free when
    not measured), and between the nodes a ring of the nodes in which each host sends ``2 (N-1)/N`` of the gradient
    (its ranks' shards together) in ``wire``'s bytes, in chunks of ``chunk_bytes``; the two phases pipeline, so the
    step takes the longer one plus one chunk of the shorter.  The link's bandwidth is the probe's point-to-point
    figure, taken as the host's: the ranks of a node share its link.
    """
    if gradient_bytes < 0 or nodes < 1 or local < 1:
        raise ValueError(f"need gradient_bytes >= 0 and nodes, local >= 1; got {gradient_bytes}, {nodes}, {local}")
    if wire not in WIRE_BYTES:
        raise ValueError(f"wire: {wire!r} is not one of {', '.join(WIRE_BYTES)}")
    ratio = WIRE_BYTES[wire] / 4
    if nodes == 1:
        link = intra or inter
        return CommForecast("flat", "fp32", 0, link.all_reduce_s(gradient_bytes, local))
    wire_bytes = int(gradient_bytes * ratio)
    if not hierarchical:
        ranks = nodes * local
        return CommForecast("flat", wire, int(2 * (ranks - 1) / ranks * wire_bytes),
                            inter.all_reduce_s(wire_bytes, ranks))
    chunks = max(1, -(-gradient_bytes // max(1, chunk_bytes)))
    host_bytes = int(2 * (nodes - 1) / nodes * wire_bytes)
    # one ring among the nodes for the bytes, and its latencies once a chunk
    between = inter.all_reduce_s(wire_bytes, nodes) + 2 * (nodes - 1) * inter.latency_s * (chunks - 1)
    within = 0.0
    if intra is not None and local > 1:
        within = intra.reduce_scatter_s(gradient_bytes, local) + intra.all_gather_s(gradient_bytes, local)
    return CommForecast("hierarchical", wire, host_bytes, max(between, within) + min(between, within) / chunks)


CHUNK_CHOICES = (4 << 20, 8 << 20, 16 << 20)
"""The pipelined chunk sizes ``choose_path`` considers. None below 4 MiB: the model has no per-chunk CPU cost, and
1 MiB chunks measured slower than 4 MiB on the local cluster (1.14x against 1.20-1.24x DDP-gloo; CHANGELOG
2026-12-06), where it predicts them faster."""


@dataclass(frozen=True, slots=True)
class PathChoice:
    """``dist.hierarchical=auto``'s choice between the flat and the hierarchical all-reduce (``choose_path``)."""

    hierarchical: bool
    chunk_bytes: int
    """The hierarchical path's pipelined chunk (the fastest of ``CHUNK_CHOICES``), also when flat is chosen."""
    flat: CommForecast
    nested: CommForecast
    """The hierarchical path's forecast at ``chunk_bytes``."""

    @property
    def chosen(self) -> CommForecast:
        return self.nested if self.hierarchical else self.flat

    def describe(self) -> str:
        """One line for the log: the choice and both forecasts."""
        chunk = f", {self.chunk_bytes >> 20} MiB chunks" if self.hierarchical else ""
        return (f"{'hierarchical' if self.hierarchical else 'flat'}{chunk} (forecast of a step's all-reduce: "
                f"hierarchical {self.nested.seconds * 1e3:.1f} ms with {self.chunk_bytes >> 20} MiB chunks, "
                f"flat {self.flat.seconds * 1e3:.1f} ms)")


def choose_path(gradient_bytes: int, *, nodes: int, local: int, inter: LinkCost, intra: LinkCost | None,
                chunks: tuple[int, ...] = CHUNK_CHOICES) -> PathChoice:
    """The exact path the forecast says is faster (pure): hierarchical at its best chunk of ``chunks`` (ties go to
    the smaller, which pipelines deeper), or flat where that is faster, as on a node whose ranks reach each
    other more slowly than they reach the other nodes. Only exact paths: lossy compression is the user's choice."""
    flat = forecast_allreduce(gradient_bytes, nodes=nodes, local=local, hierarchical=False, inter=inter,
                              intra=intra)
    nested, chunk = min(((forecast_allreduce(gradient_bytes, nodes=nodes, local=local, hierarchical=True,
                                             inter=inter, intra=intra, chunk_bytes=c), c) for c in chunks),
                        key=lambda option: (option[0].seconds, option[1]))
    return PathChoice(nested.seconds <= flat.seconds, chunk, flat, nested)


def measured_speeds(step_times_s: list[float]) -> list[float]:
    """Relative speeds from each rank's measured time for the same work: the fastest is 1.0.

    Args:
        step_times_s: seconds each rank took for one unit of work, by rank.

    Returns:
        ``min(step_times_s) / t`` for each rank, in (0, 1].
    """
    if not step_times_s:
        raise ValueError("step_times_s must hold at least one rank's time")
    for rank, time_s in enumerate(step_times_s):
        _check_positive(f"step_times_s[{rank}]", time_s)
    fastest_s = min(step_times_s)
    return [fastest_s / time_s for time_s in step_times_s]
