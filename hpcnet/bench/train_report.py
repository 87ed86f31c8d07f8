"""bench train's record and table of one model: figures per contender, the paired hpcnet/DDP ratio and the link
figures (``_model_result``), printed by ``format_model``."""

import argparse
from typing import Any

from hpcnet.bench.common import summarize, table
from hpcnet.bench.train_contenders import Contender, ModelSpec
from hpcnet.bench.train_link import _link_result, exposed_comm


def _model_result(name: str, spec: ModelSpec, contenders: list[Contender], seconds: dict[str, list[float]],
                  profiles: dict[str, Any], diff: float, batch_size: int, world_size: int,
                  args: argparse.Namespace, link: dict[str, Any], measured_gbit: float | None = None
                  ) -> dict[str, Any]:
    """The JSON record of one model: figures per contender and the paired hpcnet/DDP ratio."""
    from hpcnet.models import count_parameters

    global_batch = batch_size * world_size
    hp, ddp = contenders[0].name, contenders[1].name
    gradient_bytes = sum(p.numel() * p.element_size() for p in contenders[0].model.parameters())
    result: dict[str, Any] = {
        "name": name, "model": spec.model, "options": spec.options, "kind": spec.kind,
        "input_shape": list(spec.input_shape),
        "parameters": count_parameters(contenders[0].model),
        "gradient_mib": gradient_bytes / 2**20,
        "batch_per_rank": batch_size, "global_batch": global_batch, "steps_per_block": args.steps,
        "rounds": args.rounds, "hpcnet_backend": contenders[0].dp.describe(), "precision": args.precision,
        "max_param_diff_hpcnet_vs_ddp": diff, "contenders": {},
    }
    for c in contenders:
        t = seconds[c.name]
        result["contenders"][c.name] = {
            "samples_per_s": summarize([args.steps * global_batch / x for x in t]),
            "step_ms": summarize([x / args.steps * 1e3 for x in t]),
            "block_s_rounds": t,
            "profile": profiles.get(c.name, {}),
        }
    # Paired per round (same moment, same load), then the median.
    result["ratio_hpcnet_vs_ddp"] = summarize([d / h for h, d in zip(seconds[hp], seconds[ddp])])
    result["ratio_hpcnet_vs"] = {c.name: summarize([d / h for h, d in zip(seconds[hp], seconds[c.name])])
                                 for c in contenders[2:] if c.name.startswith("ddp")}
    result["target"] = spec.target
    result["met"] = result["ratio_hpcnet_vs_ddp"]["median"] >= spec.target
    _link_result(result, gradient_bytes, ddp, link, args, measured_gbit)
    return result


def format_model(res: dict[str, Any]) -> str:
    lines = [f"{res['model']} {res['options'] or ''} ({res['kind']}): {res['parameters'] / 1e6:.1f} M parameters, "
             f"{res['gradient_mib']:.0f} MiB of gradients, batch {res['batch_per_rank']}/rank "
             f"({res['global_batch']} global), {res['rounds']} rounds x {res['steps_per_block']} steps, "
             f"{res.get('precision', 'fp32')}",
             f"hpcnet: {res['hpcnet_backend']}"]
    lines.append(_describe_link(res))
    header = ["contender", "samples/s", "spread", "best", "step ms", "comm cost ms", "fwd+bwd ms", "exposed comm ms",
              "optimizer ms", "comm busy ms", "comm hidden", "link MiB/step out/in", "vs ddp", "exposed/floor"]
    rows = []
    contenders = res["contenders"]
    local = contenders.get("local")
    for name, c in contenders.items():
        p = c["profile"]
        # What communication costs in all: the step time over the local step's.
        cost = f"{c['step_ms']['median'] - local['step_ms']['median']:.1f}" if local and name != "local" else "-"
        exposed_ms, estimated = exposed_comm(name, p, local["profile"] if local else None)
        mark = "~" if estimated else ""  # DDP waits inside backward: its extra backward time over the local model's
        exposed = "-" if exposed_ms is None else f"{mark}{exposed_ms:.1f}"
        busy = p.get("comm_busy_ms")
        sent, received = c.get("link_tx_bytes_per_step"), c.get("link_rx_bytes_per_step")
        vs_ddp, vs_floor = c.get("link_bytes_vs_ddp"), c.get("exposed_comm_vs_link_floor")
        rows.append([name, f"{c['samples_per_s']['median']:.1f}", f"{100 * c['samples_per_s']['spread']:.0f}%",
                     f"{c['samples_per_s']['max']:.1f}",
                     f"{c['step_ms']['median']:.1f}", cost,
                     f"{p['forward_backward_ms']:.1f}" if p else "-", exposed,
                     f"{p['optimizer_ms']:.1f}" if p else "-", "-" if busy is None else f"{busy:.1f}",
                     f"{100 * p['comm_hidden_ms'] / busy:.0f}%" if busy else "-",
                     "-" if sent is None else f"{sent / 2**20:.1f}/{received / 2**20:.1f}",
                     "-" if vs_ddp is None else f"{vs_ddp:.2f}",
                     "-" if vs_floor is None else f"{mark}{vs_floor:.2f}"])
    ratio = res["ratio_hpcnet_vs_ddp"]
    lines.append(table(header, rows))
    lines.append("samples/s: median of the rounds (spread (max-min)/median, best = max); comm cost: step time over "
                 "local's; fwd+bwd, exposed comm (after backward; DDP ~ its backward over local's), optimizer (clip "
                 "+ step), comm busy (MPI calls' wall time) and hidden (share of it before backward ended) from the "
                 "instrumented block, medians; link MiB/step: bytes a timed step sends out of / receives into a "
                 "host over its non-loopback interfaces (their counters, heartbeat and control traffic included; "
                 "median of the rounds, busiest host; '-' on one host), vs ddp: bytes sent over DDP's, "
                 "exposed/floor: exposed comm over the link floor")
    for name, other in res.get("ratio_hpcnet_vs", {}).items():
        lines.append(f"hpcnet / {name} samples/s: {other['median']:.3f} (per-round paired, range "
                     f"{other['min']:.2f}-{other['max']:.2f})")
    lines.append(f"hpcnet / DDP samples/s: {ratio['median']:.3f} (per-round paired, range {ratio['min']:.2f}-"
                 f"{ratio['max']:.2f}); target >= {res['target']}: {'met' if res['met'] else 'NOT met'}; "
                 f"max |weight difference| hpcnet vs DDP after the run: {res['max_param_diff_hpcnet_vs_ddp']:.2e}")
    return "\n".join(lines)


def _describe_link(res: dict[str, Any]) -> str:
    """The line above a model's table: the hosts, the link speed and the link floor."""
    link = res.get("link") or {}
    if link.get("hosts", 0) < 2:
        return "link: one host, nothing crosses hosts (link columns '-')"
    text = f"link: {link['hosts']} hosts, "
    nominal = (f"; nominal {link['nominal_gbit']:g} Gbit/s ({link['nominal_source']})"
               if link.get("nominal_gbit") is not None else "")
    if link["gbit"] is None:
        return text + "rate not measured (--link-gbit G for the floor)" + nominal
    return (text + f"{link['gbit']:.3g} Gbit/s ({link['gbit_source']}){nominal}; floor: an exact hierarchical "
            f"all-reduce sends {link['floor_bytes_per_host'] / 2**20:.1f} MiB out of each host a step, "
            f"{link['floor_ms']:.1f} ms")
