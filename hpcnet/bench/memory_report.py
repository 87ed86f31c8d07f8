"""bench memory's printed tables: the contenders' memory and step time on a model, the capacity search, and
FSDP2's largest model, each with the issues' targets."""

import argparse
from typing import Any

from hpcnet.bench.common import table
from hpcnet.bench.memory_contenders import TIME_PEERS

CAPACITY_TARGETS = {"hpcnet-best / fsdp2-best": 1.25, "hpcnet-zero3 / fsdp2": 1.0, "hpcnet-zero2 / ddp": 2.0}
"""The largest model under the cap, parameters over parameters: the issues' targets (31 for stage 3, 12 for 2)."""
FSDP2_MODEL_TIME_TARGET = ("hpcnet-zero3", 0.9)
"""Issue 31: stage 3's step time on FSDP2's largest model at most this times FSDP2's (median of paired rounds)."""


def _ms(summary: dict[str, float]) -> str:
    return f"{summary['median'] * 1e3:.0f} ({summary['min'] * 1e3:.0f}-{summary['max'] * 1e3:.0f})"


def _ratio(summary: dict[str, float]) -> str:
    return f"{summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f})"


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    memory, timing, ratios = out["memory"], out["timing"], out["time_ratios"]
    ddp_held, ddp_peak = max(memory["ddp"]["held_mib"]), max(memory["ddp"]["peak_mib"])
    rows = []
    peers = [p for p in TIME_PEERS if p in ratios]
    for name, r in memory.items():
        held, peak = max(r["held_mib"]), max(r["peak_mib"])
        tensors = [t for t in r["tensors_mib"] if t]
        counted = (" / ".join(f"{max(t[k] for t in tensors):.1f}" for k in ("params", "grads", "optim"))
                   if tensors else "-")
        rows.append([name, f"{held:.1f}", f"{held / ddp_held:.2f}", f"{peak:.1f}", f"{peak / ddp_peak:.2f}",
                     _ms(timing[name]["step_s_summary"]), *(_ratio(ratios[p][name]) for p in peers), counted])
    head = (f"{out['model']}: {out['parameters'] / 1e6:.1f} M parameters ({out['parameters'] * 4 / 2**20:.0f} MiB "
            f"in fp32), {out['optimizer']}")
    lines = [head, table(["contender", "held MiB", "/ddp", "peak MiB", "/ddp", "step ms (range)",
                          *(f"/{p.removeprefix('hpcnet-')}" for p in peers),
                          "hpcnet tensors MiB: params / grads+buckets / optim"], rows)]
    lines.append("held: resident memory after the steps above what the rank held before the contender was built; "
                 "peak: its high-water mark during them; both the largest rank's. step: the slowest rank's, "
                 f"{args.rounds} rounds x {args.round_steps} steps after {args.steps} warm-up steps, median "
                 "(range); ratios paired round by round, median (range). max |weight difference| from "
                 f"hpcnet-zero0 after the steps: {out['max_weight_difference']:.2e} "
                 f"({', '.join(f'{k} {v:.1e}' for k, v in out['differences'].items())}); with checkpointing "
                 f"from without: {out['max_checkpointing_difference']:.2e} "
                 f"({', '.join(f'{k} {v:.1e}' for k, v in out['checkpointing_differences'].items())})")
    for t in out["targets"]:
        lines.append(f"target (stated at 4 ranks; here {t['ranks']}): {t['what']} "
                     f"{t['value']:.2f} <= {t['at_most']}: {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def report_capacity(cap: dict[str, Any]) -> str:
    rows = []
    for t in cap["trials"]:
        rung = f"{t['rung']}" + (f" +{t['extra_blocks']} blocks" if t.get("extra_blocks") else "")
        rows.append([t["contender"], rung, f"{t['d_model']} x {t['n_layers']}",
                     f"{t['parameters'] / 1e6:.1f}", f"{t['peak_bytes'] / 2**20:.0f}", f"{t['step_s'] * 1e3:.0f}",
                     "yes" if t["fits"] else "no"])
    lines = [f"largest transformer under a cap of {cap['cap_bytes'] / 1e9:g} GB ({cap['cap_bytes'] / 2**20:.0f} MiB) "
             f"of peak per rank (batch {cap['batch'][0]} x {cap['batch'][1]} tokens, vocabulary {cap['vocab']}, "
             f"{cap['steps']} steps a trial); rungs tried:",
             table(["contender", "rung", "width x depth", "M params", "peak MiB", "step ms", "fits"], rows)]
    rows = []
    for name, f in cap["largest"].items():
        rung = f"{f['rung']}" + (f" +{f['extra_blocks']} blocks" if f["extra_blocks"] else "")
        above = (f"{f['next_parameters'] / 1e6:.1f} M: {f['next_peak_bytes'] / 2**20:.0f} MiB"
                 if f["next_parameters"] else "-")
        rows.append([name, rung if f["rung"] else "none", f"{f['d_model']} x {f['n_layers']}" if f["rung"] else "-",
                     f"{f['parameters'] / 1e6:.1f}", f"{f['peak_bytes'] / 2**20:.0f}" if f["rung"] else "-", above,
                     str(f["start_rung"]), str(f["trials"])])
    lines += ["largest that fit, per contender:",
              table(["contender", "rung", "width x depth", "M params", "peak MiB", "next size tried: peak",
                     "first rung", "trials"], rows)]
    for what, r in cap["ratios"].items():
        bounds = ""
        if r["bracket"]:
            bounds = f"; between the sizes tried, the true ratio lies in {r['bracket'][0]:.2f}-{r['bracket'][1]:.2f}"
        bound = CAPACITY_TARGETS.get(what)
        target = f", target >= {bound:g}: {'met' if r['ratio'] >= bound else 'NOT met'}" if bound else ""
        lines.append(f"parameters, {what} ({r['numerator']} / {r['denominator']}): {r['ratio']:.2f}{target}{bounds}")
    return "\n".join(lines)


def report_fsdp2_model(out: dict[str, Any], cap_gb: float) -> str:
    memory, peer = out["memory"], out["peer"]
    peer_held, peer_peak = max(memory[peer]["held_mib"]), max(memory[peer]["peak_mib"])
    rows = []
    for name, r in memory.items():
        held, peak = max(r["held_mib"]), max(r["peak_mib"])
        rows.append([name, f"{held:.0f}", f"{held / peer_held:.2f}", f"{peak:.0f}", f"{peak / peer_peak:.2f}",
                     "yes" if peak * 2**20 <= cap_gb * 1e9 else "no", _ms(out["step_s_summary"][name]),
                     _ratio(out["time_ratios"][name])])
    return "\n".join([
        f"on FSDP2's largest model, {out['d_model']} x {out['n_layers']} ({out['parameters'] / 1e6:.1f} M parameters), "
        f"without the cap; {out['rounds']} rounds x 1 step in rotated order:",
        table(["contender", "held MiB", f"/{peer}", "peak MiB", f"/{peer}", "under cap", "step ms (range)",
               f"/{peer} (paired)"], rows), *_time_target(out)])


def _time_target(out: dict[str, Any]) -> list[str]:
    name, bound = FSDP2_MODEL_TIME_TARGET
    if out["peer"] != "fsdp2" or name not in out["time_ratios"]:
        return []
    median = out["time_ratios"][name]["median"]
    return [f"step time, {name} / fsdp2 (median of paired rounds): {median:.2f}, target <= {bound:g}: "
            f"{'met' if median <= bound else 'NOT met'}"]

