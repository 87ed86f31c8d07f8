"""The cost model applied to this job's gradients: which path they take under ``dist.hierarchical=auto``
(``choose_hierarchical``), what a step's all-reduce should take (``forecast_comm``, logged by rank 0 beside what
the other paths and wire formats would send and take), and that forecast against the measurement
(``check_forecast``).  The model itself is ``hpcnet.comm.costmodel``'s."""

import dataclasses
import logging
from typing import Any

from hpcnet.comm.costmodel import CommForecast, LinkCost, PathChoice, choose_path, forecast_allreduce
from hpcnet.comm.route import Route
from hpcnet.comm.transport.hierarchical import PIPELINE_CHUNK_BYTES
from hpcnet.config import DistConfig
from hpcnet.world import World

log = logging.getLogger(__name__)

FORECAST_CHECK_STEP = 20
"""The step at which rank 0 logs the measured all-reduce time beside the forecast (``check_forecast``)."""


def choose_hierarchical(route: Route, cfg: DistConfig, comm: Any, world: World, gradient_bytes: int, *,
                        inter: LinkCost | None, intra: LinkCost | None) -> tuple[Route, PathChoice | None]:
    """``dist.hierarchical=auto`` where the layout allows both paths, the sums are exact and the links were probed:
    the flat or the hierarchical all-reduce and its chunk, whichever the forecast says is faster
    (``costmodel.choose_path``); rank 0's choice, so every rank builds the same transport (collective).  Returns
    the route to follow and the choice (None where there was none to make)."""
    if (inter is None or cfg.hierarchical != "auto" or not route.hierarchical or world.num_nodes <= 1
            or cfg.compression not in ("none", "auto")):
        return route, None
    choice = choose_path(gradient_bytes, nodes=world.num_nodes, local=world.size // world.num_nodes, inter=inter,
                         intra=intra) if world.is_main else None
    choice = comm.bcast(choice, root=0)
    if world.is_main:
        log.info("dist.hierarchical=auto: %s", choice.describe())
    return (route if choice.hierarchical else dataclasses.replace(route, hierarchical=False, inter_node=None)), choice


def forecast_comm(gradient_bytes: int, cfg: DistConfig, world: World, *, hierarchical: bool, inter: LinkCost,
                  intra: LinkCost | None, chunk_bytes: int | None) -> CommForecast:
    """The cost model's prediction of a step's all-reduce on the path taken (``forecast_allreduce``), logged by
    rank 0 with what the other paths and wire formats would send and take, so a user sees what lossy compression
    would save before opting in (``dist.compression=auto`` never chooses it).  ``chunk_bytes``: the transport's
    pipelined chunk (None: it sends buckets whole; the other paths are then forecast at the hierarchical
    transport's default chunk)."""
    local = world.size // world.num_nodes
    wire = "fp32" if cfg.compression in ("auto", "none") or world.num_nodes == 1 else cfg.compression
    chunk = PIPELINE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes

    def model(nested: bool, wire: str) -> CommForecast:
        return forecast_allreduce(gradient_bytes, nodes=world.num_nodes, local=local, hierarchical=nested,
                                  inter=inter, intra=intra, wire=wire, chunk_bytes=chunk)
    chosen = model(hierarchical, wire)
    if world.is_main:
        text = (f"{chosen.path} {chosen.wire}: {chosen.seconds * 1e3:.1f} ms a step"
                + (f", {chosen.host_bytes / 2**20:.1f} MiB out of each host" if world.num_nodes > 1 else ""))
        if world.num_nodes > 1:
            others = [model(h, w) for h, w in [(False, "fp32"), (True, "fp32"), (True, "bf16"), (True, "int8")]
                      if (h, w) != (hierarchical, wire)]
            text += "; " + ", ".join(f"{f.path} {f.wire} {f.seconds * 1e3:.1f} ms, {f.host_bytes / 2**20:.1f} "
                                     "MiB" for f in others)
            if cfg.compression == "auto":
                text += " (bf16 and int8 are lossy: opt in with dist.compression)"
        links = f"{'inter-node ' if world.num_nodes > 1 else ''}link {inter.latency_s * 1e6:.1f} us, " \
                f"{inter.bandwidth_Bps * 8 / 1e9:.2f} Gbit/s"
        if intra is not None and world.num_nodes > 1:
            links += f"; intra-node {intra.latency_s * 1e6:.1f} us, {intra.bandwidth_Bps * 8 / 1e9:.2f} Gbit/s"
        log.info("communication forecast (%s): %s", links, text)
    return chosen


def check_forecast(forecast: CommForecast | None, measured_s: float | None, world: World) -> None:
    """Rank 0 logs the measured all-reduce time (``measured_s``) beside the forecast (at ``FORECAST_CHECK_STEP``)."""
    if forecast is None or measured_s is None or not world.is_main:
        return
    log.info("communication: forecast %.1f ms a step, measured %.1f ms (median since step 2: first bucket sent to "
             "every sum in; what backward hides of it is in the trace's phases)", forecast.seconds * 1e3,
             measured_s * 1e3)
