"""bench memory's capacity search (``--cap-gb``): the largest transformer of a ladder (rung k: width 64k, k
blocks, k heads) each contender trains with every rank's peak under a cap, and memory and step time on FSDP2's
largest model.

The ladder's sizes and the search are pure (tested on one process); a trial builds and trains one size
(``cap_trial``); ``bench_capacity`` searches each contender, ``bench_fsdp2_model`` times the contenders of
``--cap-time`` on the largest size FSDP2 fitted.
"""

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpcnet.bench.common import summarize
from hpcnet.bench.memory_contenders import CONTENDERS, _batches, _build
from hpcnet.bench.memory_measure import measure, paired_ratios
from hpcnet.plan.measure import reset_peak as _reset_peak
from hpcnet.plan.measure import settled_kib as _settle
from hpcnet.plan.measure import status_kib as _status_kib

CAP_VOCAB, CAP_SEQ, CAP_BATCH = 8192, 64, 4  # the capacity ladder's data: the table's transformer's
CAP_TOP_RUNG = 32  # width 2048, 32 blocks: 1.6 G parameters, far beyond this machine


def ladder_options(rung: int) -> dict[str, int]:
    """The transformer of capacity rung ``rung`` (>= 1): width 64 * rung, ``rung`` blocks of ``rung`` heads of 64."""
    if rung < 1:
        raise ValueError(f"a ladder rung is at least 1, got {rung}")
    return {"d_model": 64 * rung, "n_layers": rung, "n_heads": rung}


def transformer_parameters(d_model: int, n_layers: int, vocab: int = CAP_VOCAB, seq: int = CAP_SEQ) -> int:
    """Parameters of ``hpcnet.models.transformer`` with tied embeddings and d_ff = 4 * d_model."""
    per_block = 12 * d_model * d_model + 13 * d_model  # qkv, proj, ff_in, ff_out with biases; two LayerNorms
    return n_layers * per_block + (vocab + seq + 2) * d_model  # token and position embeddings, final LayerNorm


def rung_parameters(rung: int) -> int:
    options = ladder_options(rung)
    return transformer_parameters(options["d_model"], options["n_layers"])


def start_rung(cap_bytes: float, bytes_per_param: float, top: int = CAP_TOP_RUNG) -> int:
    """The largest rung whose parameters times ``bytes_per_param`` fit ``cap_bytes`` (at least 1): a first guess."""
    fitting = [k for k in range(1, top + 1) if rung_parameters(k) * bytes_per_param <= cap_bytes]
    return max(fitting, default=1)


def deeper_options(rung: int, most: int = 4) -> list[dict[str, int]]:
    """The refinement between rung ``rung`` and the next: rung ``rung``'s width with more blocks, while it has
    fewer parameters than rung ``rung + 1`` (the ladder alone moves in steps of 25-45% of parameters); at most
    ``most`` of them, evenly spaced (small rungs, dominated by the embedding, would have dozens)."""
    out = []
    limit = rung_parameters(rung + 1)
    options = ladder_options(rung)
    for extra in range(1, 10 * rung + 10):
        deeper = {**options, "n_layers": rung + extra}
        if transformer_parameters(deeper["d_model"], deeper["n_layers"]) >= limit:
            break
        out.append(deeper)
    step = -(-len(out) // most) if out else 1
    return out[step - 1::step]


def search_largest(fits: Callable[[int], bool], start: int, top: int) -> tuple[int, dict[int, bool]]:
    """The largest k in 1..top with ``fits(k)`` (0 if none), for a ``fits`` that is true up to some k and false
    above it, starting from ``start`` and stepping one rung at a time, so the answer k has ``fits(k)`` and
    ``fits(k + 1)`` (below ``top``) both evaluated. Returns it and every evaluation made."""
    if not 1 <= start <= top:
        raise ValueError(f"the start rung {start} is outside 1..{top}")
    seen: dict[int, bool] = {}
    k = start
    seen[k] = fits(k)
    if seen[k]:
        while k < top:
            seen[k + 1] = fits(k + 1)
            if not seen[k + 1]:
                break
            k += 1
        return k, seen
    while k > 1:
        k -= 1
        seen[k] = fits(k)
        if seen[k]:
            return k, seen
    return 0, seen


def capacity_ratio(found: dict[str, dict[str, Any]], numerator: list[str], denominator: list[str]
                   ) -> dict[str, Any] | None:
    """Parameters of the largest model any of ``numerator`` trained over the largest any of ``denominator`` did.

    Args:
        found: each contender's answer: ``parameters`` of the largest size that fit (0: none) and
            ``next_parameters``, the next size tried, which did not fit (None: none above was tried).

    Returns:
        None where a side is absent or fitted nothing; else the ratio, the contender on each side, and
        ``bracket``: the bounds the true ratio lies in, each side's true largest lying between the largest size
        of its contenders that fit and the largest next size (None where a next size is missing).
    """
    sides = [[found[n] | {"name": n} for n in names if n in found] for names in (numerator, denominator)]
    if not all(sides) or not all(max(f["parameters"] for f in side) for side in sides):
        return None
    (top, low), bounds = [max(side, key=lambda f: f["parameters"]) for side in sides], []
    for side in sides:
        nexts = [f["next_parameters"] for f in side]
        bounds.append(max(nexts) if None not in nexts else None)
    bracket = None
    if None not in bounds:
        bracket = [top["parameters"] / bounds[1], bounds[0] / low["parameters"]]
    return {"ratio": top["parameters"] / low["parameters"], "numerator": top["name"], "denominator": low["name"],
            "bracket": bracket}


def _ladder_model(options: dict[str, int]) -> nn.Module:
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    torch.manual_seed(0)
    return build_model("transformer", DatasetInfo("tokens", (CAP_SEQ,), CAP_VOCAB), options)


def cap_trial(name: str, rung: int, comm: Any, world: Any, args: argparse.Namespace,
              options: dict[str, int] | None = None) -> dict[str, Any]:
    """Build and train rung ``rung`` (or ``options``, a refinement of it) with ``name`` for ``--cap-steps`` steps;
    its peak above the rank's settled memory before the model was made, the largest rank's (collective)."""
    from mpi4py import MPI

    options = options or ladder_options(rung)
    batches = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, world.rank)
    before = _settle()
    comm.Barrier()
    _reset_peak()
    contender = _build(name, _ladder_model(options), comm, world, args.optim)
    t0 = time.perf_counter()
    for _ in range(args.cap_steps):
        contender.step(batches)
    seconds = (time.perf_counter() - t0) / args.cap_steps
    peak_kib = _status_kib("VmHWM") - before
    contender.close()
    del contender
    peak = comm.allreduce(peak_kib, op=MPI.MAX) * 1024
    return {"contender": name, "rung": rung, "extra_blocks": options["n_layers"] - rung, **options,
            "parameters": transformer_parameters(options["d_model"], options["n_layers"]), "peak_bytes": peak,
            "fits": bool(peak <= args.cap_gb * 1e9),
            "step_s": comm.allreduce(seconds, op=MPI.MAX)}


def bench_capacity(comm: Any, world: Any, args: argparse.Namespace, measured: dict[str, float]) -> dict[str, Any]:
    """The largest ladder size each of ``--cap-contenders`` trains under ``--cap-gb`` (collective).

    Args:
        measured: bytes of peak per parameter each contender showed on the table's transformer in this run
            (where it ran), which picks the first rung to try; the search itself measures.
    """
    cap = args.cap_gb * 1e9
    found: dict[str, Any] = {}
    trials: list[dict[str, Any]] = []
    # An unmeasured trial of each first: seen here, DDP's first trial in a process peaked 120 MiB higher than
    # the same trial after it (what the first use of autograd and gloo allocates for good).
    for name in args.cap_contenders:
        cap_trial(name, 1, comm, world, args)
    for name in args.cap_contenders:
        spec = CONTENDERS[name]
        twin = found.get(spec.plain, {}).get("rung", 0)
        # Checkpointing only lowers the peak: start at the rung above the twin's answer (one trial where it fits
        # no more, one or two fewer than a guess would cost), else from the bytes per parameter.
        start = (min(twin + 1, CAP_TOP_RUNG) if twin else
                 start_rung(cap, measured.get(name, spec.guess_bytes_per_param)))
        results: dict[int, dict[str, Any]] = {}

        def fits(rung: int, name: str = name, results: dict[int, dict[str, Any]] = results) -> bool:
            results[rung] = cap_trial(name, rung, comm, world, args)
            return results[rung]["fits"]

        best, _ = search_largest(fits, start, CAP_TOP_RUNG)
        tried = [results[k] for k in sorted(results)]
        largest = results[best] if best else None
        if best and best < CAP_TOP_RUNG:
            # Then rung ``best``'s width with more blocks, up to the first that does not fit.
            for options in deeper_options(best):
                trial = cap_trial(name, best, comm, world, args, options)
                tried.append(trial)
                if not trial["fits"]:
                    break
                largest = trial
        trials.extend(tried)
        above = min((t for t in tried if not t["fits"] and largest and t["parameters"] > largest["parameters"]),
                    key=lambda t: t["parameters"], default=None)
        found[name] = {"rung": best, "extra_blocks": largest["extra_blocks"] if largest else 0,
                       "parameters": largest["parameters"] if largest else 0,
                       **({k: largest[k] for k in ("d_model", "n_layers", "n_heads")} if largest else {}),
                       "peak_bytes": largest["peak_bytes"] if largest else None,
                       "start_rung": start, "trials": len(tried),
                       "next_parameters": above["parameters"] if above else None,
                       "next_peak_bytes": above["peak_bytes"] if above else None}
        if world.rank == 0:
            print(f"capacity: {name} done ({len(tried)} trials, {time.strftime('%H:%M:%S')})", flush=True)
    hpcnet = [n for n in found if CONTENDERS[n].kind == "hpcnet"]
    fsdp2 = [n for n in found if CONTENDERS[n].kind == "fsdp2"]
    ratios = {"hpcnet-best / fsdp2-best": capacity_ratio(found, hpcnet, fsdp2),
              "hpcnet-zero3 / fsdp2": capacity_ratio(found, ["hpcnet-zero3"], ["fsdp2"]),
              "hpcnet-zero2 / fsdp2": capacity_ratio(found, ["hpcnet-zero2"], ["fsdp2"]),
              "hpcnet-zero2 / ddp": capacity_ratio(found, ["hpcnet-zero2"], ["ddp"])}
    return {"cap_bytes": cap, "steps": args.cap_steps, "batch": [CAP_BATCH, CAP_SEQ], "vocab": CAP_VOCAB,
            "largest": found, "trials": trials, "ratios": {k: v for k, v in ratios.items() if v}}


def bench_fsdp2_model(comm: Any, world: Any, args: argparse.Namespace, cap: dict[str, Any]) -> dict[str, Any] | None:
    """Memory and step time of ``--cap-time`` on the largest size FSDP2 fitted under the cap (collective); None
    where FSDP2 was not searched or fitted nothing."""
    fsdp2 = cap["largest"].get("fsdp2")
    if not fsdp2 or not fsdp2["rung"] or not args.cap_time:
        return None
    options = {k: fsdp2[k] for k in ("d_model", "n_layers", "n_heads")}
    batches = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, world.rank)
    names = list(args.cap_time)
    memory, per_round, slowest, alive = measure(names, lambda: _ladder_model(options), batches, comm, world, args,
                                                steps=args.cap_steps, rounds=args.cap_rounds, round_steps=1)
    for name in names:
        alive.pop(name).close()
    if world.rank != 0:
        return {}
    peer = "fsdp2" if "fsdp2" in names else names[0]
    return {**options, "parameters": fsdp2["parameters"], "rounds": args.cap_rounds, "peer": peer,
            "memory": memory, "step_s_rounds": per_round,
            "step_s_summary": {n: summarize(slowest[i].reshape(-1).tolist()) for i, n in enumerate(names)},
            "time_ratios": {n: paired_ratios(per_round[n], per_round[peer]) for n in names}}

