"""Training samples/s of hpcnet's data-parallel step against torch DistributedDataParallel, same run.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench train [--models mlp,resnet18] [--json out.json]

Both contenders train their own copy of the same model (same initial weights,
optimizer, gradient clipping) on the same synthetic batches, already in
memory, so no data loading is timed.  hpcnet runs ``DataParallel.step`` with
the default configuration (``auto`` backend: MPI on CPU, NCCL on GPU); DDP
runs with its defaults on the torch.distributed group (gloo on CPU, NCCL on
GPU).  After a warm-up, blocks of steps alternate between the contenders for
several rounds, so a load change on a shared machine hits both alike;
figures are medians over the rounds.  A third contender without any
communication (``local``) shows the compute floor.  A last, instrumented
block splits the step time and measures how much of hpcnet's communication
hides behind the backward pass.

Across hosts, one rank a host (local rank 0) reads its host's interface
counters (``/sys/class/net/<if>/statistics``, loopback left out) before and
after each timed block: the bytes a step sends out of a host and receives,
per contender, set against the link floor, the time an exact hierarchical
all-reduce needs to send the gradient out of each host once at the link's
rate: ``--link-gbit``, else the rate the topology probe measures between the
hosts (``hpcnet.comm.topology``, once before the models), never the
interfaces' nominal speed (a tc limit or a slower switch port does not show
there), which the line above each table gives beside it.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcnet.bench.common import (
    counter_delta,
    describe_environment,
    environment,
    link_floor_s,
    link_speed_gbit,
    load_average,
    max_over_ranks,
    net_counters,
    summarize,
    table,
    write_json,
)
from hpcnet.bench.stepsplit import profile_block, sync_device
from hpcnet.comm.measured import HostLinks, host_links
from hpcnet.comm.topology import probe
from hpcnet.config import PRECISIONS
from hpcnet.models.device import BatchMover, DeviceSettings, apply_settings, device_settings


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A benchmark model: a built-in hpcnet model, its input and its per-rank batch."""

    model: str
    options: dict[str, Any]
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    kind: str
    target: float
    """The issue's target for hpcnet samples/s over DDP's."""


# Sized so that a step takes roughly 100-300 ms with one core per rank on the
# 2-core development machine (measured there: mlp 130 ms forward+backward and
# 65 ms optimizer, resnet18 300 ms and 14 ms).
SPECS: dict[str, ModelSpec] = {
    # 10.5 M parameters (40 MiB of gradients) for little arithmetic per sample.
    "mlp": ModelSpec("mlp", {"hidden": [2048, 2048]}, (3, 32, 32), 10, 32, "communication-heavy", 1.3),
    # 29.4 M parameters (112 MiB); about 700 ms a step there.
    "mlp-4096": ModelSpec("mlp", {"hidden": [4096, 4096]}, (3, 32, 32), 10, 16, "communication-heavy", 1.3),
    # ResNet-18 at half width: 2.8 M parameters (11 MiB), ~0.15 GFLOP per 32x32 sample forward.
    "resnet18": ModelSpec("resnet18", {"width": 32}, (3, 32, 32), 10, 8, "compute-heavy", 1.0),
    # 0.31 M parameters (1.2 MiB): communication is latency only.
    "resnet_tiny": ModelSpec("resnet_tiny", {}, (3, 32, 32), 10, 32, "compute-heavy", 1.0),
    # ResNet-50 on 224x224 ImageNet-sized inputs, 64 a GPU: 25.6 M parameters (98 MiB), ~4 GFLOP per sample
    # forward (scripts/gpu-check.sh; far too slow on a CPU).
    "resnet50": ModelSpec("resnet50", {}, (3, 224, 224), 1000, 64, "GPU", 1.0),
    # A smoke test (seconds), not a benchmark.
    "mlp-small": ModelSpec("mlp", {"hidden": [256, 256]}, (3, 32, 32), 10, 16, "smoke test", 1.0),
}
DEFAULT_MODELS = "mlp,resnet18"
MEASURED = "measured by the topology probe: the slowest host's link"
"""The source of the floor's rate without ``--link-gbit`` (``link_floor``)."""


@dataclass
class Contender:
    """One way to train: a step is ``forward_backward(inputs, targets)`` then ``update()``."""

    name: str
    model: nn.Module
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Forward, backward and gradient averaging (whatever of it is not hidden); returns the loss."""
    update: Callable[[], None]
    """Gradient clipping and the optimizer step."""
    dp: Any = None
    """hpcnet's DataParallel (for the instrumented block), else None."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(inputs, targets)
        self.update()
        return loss


DDP_HOOKS = ("bf16", "fp16", "powersgd")
"""``--ddp-hooks``: DDP's own gradient compression, as further contenders (``ddp_hook``)."""
POWERSGD_RANK = 4


def ddp_hook(ddp: Any, name: str) -> str:
    """Register DDP's communication hook ``name`` (one of ``DDP_HOOKS``) on ``ddp``; returns the contender's
    suffix.  PowerSGD (rank ``POWERSGD_RANK``, error feedback and warm start, torch's defaults) compresses from
    the second step on (torch's default waits 1,000 steps with plain all-reduces)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    cuda = next(ddp.module.parameters()).device.type == "cuda"
    if name == "bf16":
        # torch's bf16_compress_hook refuses CPU tensors (it asks for CUDA 11+ and NCCL 2.10+): on CPU, the same
        # steps over gloo (``_cast_hook``).
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if cuda else _cast_hook(torch.bfloat16))
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return f"powersgd{POWERSGD_RANK}"
    else:
        raise ValueError(f"unknown DDP hook {name!r}; choose among {', '.join(DDP_HOOKS)}")
    return name


def _cast_hook(dtype: torch.dtype) -> Callable[[Any, Any], Any]:
    """What torch's ``bf16_compress_hook`` does, for any backend: the bucket cast to ``dtype`` and divided by the
    world size, all-reduced, cast back into the bucket."""
    import torch.distributed as dist

    # DDP checks the annotations.
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        wire = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(wire, async_op=True).get_future()

        def back(done: Any) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(back)

    return hook


def make_contenders(spec: ModelSpec, comm: Any, world: Any, *, device: torch.device, local: bool,
                    seed: int = 0, dist_cfg: Any = None, precision: str = "fp32",
                    settings: Any = None, base: nn.Module | None = None,
                    ddp_hooks: tuple[str, ...] = ()) -> list[Contender]:
    """hpcnet, DDP, DDP with each of ``ddp_hooks`` and (optionally) the no-communication baseline on copies of one
    model (collective); every contender gets the same device ``settings`` (``hpcnet.models.device``:
    channels-last, fused optimizer, ...)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcnet.comm.dataparallel import DataParallel
    from hpcnet.comm.route import agree_route
    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model
    from hpcnet.objective import Objective
    from hpcnet.optim import build_optimizer

    compute_loss = Objective(device=device, precision=precision)  # every contender's forward in the same precision

    if base is None:  # the model every contender copies (``bench_model`` builds it to decide the settings)
        torch.manual_seed(seed)
        base = build_model(spec.model, DatasetInfo("image", spec.input_shape, spec.num_classes), spec.options)
    base = base.to(device)
    settings = settings or DeviceSettings()
    base = apply_settings(settings, base)
    optim_cfg = OptimConfig()  # hpcnet's defaults for every contender (SGD, momentum, weight decay, clip 1.0)

    def updater(model: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
        optimizer = build_optimizer(model, optim_cfg, fused=settings.fused_optimizer)

        def update() -> None:
            if optim_cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
            optimizer.step()

        return optimizer, update

    model_h = copy.deepcopy(base)
    dist_cfg = dist_cfg or DistConfig()  # hpcnet's defaults unless --dist says otherwise
    dp = DataParallel(model_h, comm, world, dist_cfg, device=device,
                      route=agree_route(comm, world, dist_cfg, device_type=device.type))
    update_h = updater(model_h)[1]  # at stage 0 torch's clip and step, as DDP's: the same weights, bit for bit
    if dist_cfg.zero:  # the gradients are the owners': the optimizer sharded by the owners, the clip collective
        optimizer_h = dp.shard_optimizer(build_optimizer(model_h, optim_cfg, fused=settings.fused_optimizer))

        def update_h() -> None:
            if optim_cfg.grad_clip > 0:
                dp.clip_grad_norm_(optim_cfg.grad_clip)
            optimizer_h.step()
    contenders = [Contender("hpcnet", model_h, lambda x, y: dp.step([(x, y)], compute_loss), update_h, dp)]

    model_d = copy.deepcopy(base)
    ddp = DistributedDataParallel(model_d, device_ids=[device] if device.type == "cuda" else None)  # its defaults
    # DDP all-reduces its buckets during backward and waits for them at its end.
    contenders.append(_plain(f"ddp-{dist.get_backend()}", model_d, ddp, updater, compute_loss))
    for hook in ddp_hooks:
        model_c = copy.deepcopy(base)
        # PowerSGD issues its all-reduces from the futures' callbacks; over gloo, two buckets' callbacks run them in
        # different orders on different ranks ("Received data size doesn't match expected size", an abort or a
        # hang): one bucket for it.
        cap = {"bucket_cap_mb": 1 << 16} if hook == "powersgd" and device.type != "cuda" else {}
        hooked = DistributedDataParallel(model_c, device_ids=[device] if device.type == "cuda" else None, **cap)
        suffix = ddp_hook(hooked, hook)
        contenders.append(_plain(f"ddp-{dist.get_backend()}-{suffix}", model_c, hooked, updater, compute_loss))
    if local:
        model_l = copy.deepcopy(base)
        contenders.append(_plain("local", model_l, model_l, updater, compute_loss))
    return contenders


def _plain(name: str, model: nn.Module, forward: nn.Module, updater: Callable[[nn.Module], Any],
           compute_loss: Callable[..., torch.Tensor]) -> Contender:
    """A contender whose step is zero_grad, ``forward``'s loss, backward (DDP, or no communication at all)."""
    optimizer, update = updater(model)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(forward, (x, y))
        loss.backward()
        return loss.detach()

    return Contender(name, model, forward_backward, update)


def synthetic_batches(spec: ModelSpec, batch_size: int, count: int, rank: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random batches, different on every rank, the same for every contender."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch_size, *spec.input_shape, generator=gen).to(device),
             torch.randint(0, spec.num_classes, (batch_size,), generator=gen).to(device)) for _ in range(count)]


def run_block(contender: Contender, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int, steps: int,
              comm: Any, device: torch.device) -> float:
    """Seconds for ``steps`` steps from batch number ``first``, slowest rank (collective)."""
    comm.Barrier()
    t0 = time.perf_counter()
    loss = None
    for i in range(first, first + steps):
        loss = contender.step(*batches[i % len(batches)])
    if loss is not None:
        loss.item()  # the step is finished (GPU: its kernels too)
    sync_device(device)
    return max_over_ranks(comm, time.perf_counter() - t0)


def bench_model(name: str, spec: ModelSpec, comm: Any, world: Any, args: argparse.Namespace,
                device: torch.device, measured_gbit: float | None = None) -> dict[str, Any]:
    """Warm-up, alternating timed rounds and an instrumented block for the model ``SPECS[name]`` (collective);
    ``measured_gbit``: the probe's link rate for the floor (``probe_link_gbit``)."""
    from mpi4py import MPI

    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    batch_size = args.batch_size or spec.batch_size
    torch.manual_seed(0)  # make_contenders' default seed
    base = build_model(spec.model, DatasetInfo("image", spec.input_shape, spec.num_classes), spec.options)
    settings = device_settings(args.cuda_cfg, device, base)  # what training would use on this device
    contenders = make_contenders(spec, comm, world, device=device, local=not args.no_local, dist_cfg=args.dist_cfg,
                                 precision=args.precision, settings=settings, base=base, ddp_hooks=args.hook_list)
    mover = BatchMover(device, settings)
    batches = [mover(batch) for batch in synthetic_batches(spec, batch_size, args.distinct_batches, world.rank,
                                                           device)]
    try:
        position = {c.name: 0 for c in contenders}  # every contender walks the same batch sequence

        def block(c: Contender, steps: int) -> float:
            seconds = run_block(c, batches, position[c.name], steps, comm, device)
            position[c.name] += steps
            return seconds

        reads_link = world.local_rank == 0  # one reader a host
        link_per_step: dict[str, list[tuple[float, float]]] = {c.name: [] for c in contenders}

        def timed_block(c: Contender, steps: int) -> float:
            # Read before the block's barrier and after its closing collective: every rank has finished then, so
            # every byte of the block has left its host (and arrived).
            before = net_counters() if reads_link else {}
            seconds = block(c, steps)
            if before:
                sent, received = counter_delta(before, net_counters())
                link_per_step[c.name].append((sent / steps, received / steps))
            return seconds

        for c in contenders:
            block(c, args.warmup)
        seconds = _alternate(contenders, timed_block, args.rounds, args.steps)
        profiles = {}
        if args.profile_steps:
            for c in contenders:
                profiles[c.name] = profile_block(c, batches, position[c.name], args.profile_steps, comm, device)
                position[c.name] += args.profile_steps
        link = gather_link(comm, link_per_step if reads_link else None)
    finally:
        for c in contenders:
            if c.dp is not None:
                c.dp.close()  # dist.zero=3: the parameters whole again
    # Same start, same data, same number of steps: hpcnet and DDP should hold
    # (nearly) the same weights; a large difference means they did not train alike.
    diff = max((a - b).abs().max().item() for a, b in zip(contenders[0].model.parameters(),
                                                             contenders[1].model.parameters()))
    diff = comm.allreduce(diff, op=MPI.MAX)
    result = _model_result(name, spec, contenders, seconds, profiles, diff, batch_size, world.size, args, link,
                           measured_gbit)
    result["device_settings"] = settings.describe()
    return result


def _alternate(contenders: list[Contender], block: Callable[[Contender, int], float], rounds: int,
               steps: int) -> dict[str, list[float]]:
    """Collective: ``rounds`` of one block of ``steps`` per contender; seconds per block, per contender."""
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        # Rotate who goes first, so no contender always runs right after the same one.
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            seconds[c.name].append(block(c, steps))
    return seconds


def link_host_key() -> str:
    """What tells hosts' links apart: the machine (its kernel's boot id) and the network namespace.  Ranks with one
    key read the same counters (virtual nodes of ``HPCNET_RANKS_PER_NODE`` on one host); the local cluster's hosts
    share a kernel but each has a namespace of its own."""
    from hpcnet.world import machine_id

    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{machine_id()} {netns}"


def host_link_record(per_step: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """This host's part of ``gather_link``: per contender, the medians over its timed blocks of the bytes sent and
    received a step (None without a reading), the host's ``link_host_key`` and ``link_speed_gbit``."""
    return {"host": link_host_key(), "speed": link_speed_gbit(),
            "per_step": {name: (statistics.median(s for s, _ in blocks), statistics.median(r for _, r in blocks))
                         if blocks else None for name, blocks in per_step.items()}}


def link_summary(records: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The hosts' ``host_link_record``s (None from ranks that do not read) as figures (pure): the number of hosts,
    the slowest interface speed any reports, and per contender the bytes a step sent and received out of the
    busiest host (max over hosts; also per host).  A contender's figures are None on one host (nothing crosses
    hosts) and where a host has no reading."""
    hosts: dict[str, dict[str, Any]] = {}
    for record in records:
        if record is not None:
            hosts.setdefault(record["host"], record)
    speeds = [r["speed"] for r in hosts.values() if r["speed"] is not None]
    per_contender: dict[str, dict[str, Any] | None] = {}
    for name in dict.fromkeys(name for r in hosts.values() for name in r["per_step"]):
        figures = [r["per_step"].get(name) for r in hosts.values()]
        if len(hosts) < 2 or any(f is None for f in figures):
            per_contender[name] = None
            continue
        per_contender[name] = {"tx_bytes_per_step": max(f[0] for f in figures),
                               "rx_bytes_per_step": max(f[1] for f in figures),
                               "tx_bytes_per_step_hosts": [f[0] for f in figures],
                               "rx_bytes_per_step_hosts": [f[1] for f in figures]}
    return {"hosts": len(hosts), "speed": min(speeds) if speeds else None, "per_contender": per_contender}


def gather_link(comm: Any, per_step: dict[str, list[tuple[float, float]]] | None) -> dict[str, Any]:
    """``link_summary`` of every host's link bytes (collective: every rank calls it; the ranks that read the
    counters pass their bytes a step per timed block and contender, the others None)."""
    return link_summary(comm.allgather(None if per_step is None else host_link_record(per_step)))


def exposed_comm(name: str, profile: dict[str, Any], local_profile: dict[str, Any] | None) -> tuple[float | None, bool]:
    """A contender's exposed communication in ms from the instrumented block, and whether it is an estimate: DDP
    waits inside backward, so its figure is its backward over ``local``'s; None without one."""
    if "exposed_comm_ms" in profile:
        return profile["exposed_comm_ms"], False
    if name.startswith("ddp") and profile and local_profile:
        return profile["forward_backward_ms"] - local_profile["forward_backward_ms"], True
    return None, False


def measured_link_gbit(hosts: list[HostLinks]) -> float | None:
    """The slowest host's link to the others as the topology probe measured it (``HostLinks.link_gbps``: the
    lower of its best one-way rates out and in), Gbit/s (pure).  Virtual nodes sharing a host have no link of
    their own and are left out; None where no host has a figure."""
    return min((h.link_gbps for h in hosts if not h.shared and h.link_gbps is not None), default=None)


def probe_link_gbit(comm: Any, world: Any) -> float | None:
    """Collective: ``measured_link_gbit`` of a topology probe of ``comm``; None (no probe) on one host."""
    if len(set(world.hostnames)) < 2:
        return None
    return measured_link_gbit(host_links(probe(comm, world, budget_s=2.0)))


def link_floor(gradient_bytes: int, hosts: int, *, given_gbit: float | None, measured_gbit: float | None,
               nominal: tuple[float, str] | None) -> dict[str, Any]:
    """A model's ``link`` record (pure): the rate of the floor and its source, ``--link-gbit`` (``given_gbit``)
    else the probe's ``measured_gbit``, the floor (``link_floor_s``) and the bytes it sends out of each host;
    None where there is one host or no rate.  The interfaces' ``nominal`` speed (``link_speed_gbit``) is recorded
    beside it and is never the floor's rate: a tc limit or a slower switch port does not show there."""
    gbit, source = (given_gbit, "--link-gbit") if given_gbit else (measured_gbit, MEASURED) if measured_gbit \
        else (None, None)
    floor_s = link_floor_s(gradient_bytes, hosts, gbit) if gbit and hosts > 1 else None
    return {"hosts": hosts, "gbit": gbit, "gbit_source": source,
            "floor_ms": None if floor_s is None else floor_s * 1e3,
            "floor_bytes_per_host": gradient_bytes * 2 * (hosts - 1) / hosts if hosts > 1 else None,
            "nominal_gbit": nominal[0] if nominal else None,
            "nominal_source": f"/sys/class/net/{nominal[1]}/speed" if nominal else None}


def _link_result(result: dict[str, Any], gradient_bytes: int, ddp: str, link: dict[str, Any],
                 args: argparse.Namespace, measured_gbit: float | None = None) -> None:
    """Add the link figures (``gather_link``'s ``link``, ``link_floor`` at ``--link-gbit`` or the probe's
    ``measured_gbit``) to a model's JSON record ``result``."""
    result["gradient_bytes"] = gradient_bytes
    result["link"] = link_floor(gradient_bytes, link["hosts"], given_gbit=args.link_gbit,
                                measured_gbit=measured_gbit, nominal=link["speed"])
    floor_ms = result["link"]["floor_ms"]
    per = link["per_contender"]
    ddp_sent = (per.get(ddp) or {}).get("tx_bytes_per_step")
    local_profile = result["contenders"].get("local", {}).get("profile")
    for name, c in result["contenders"].items():
        figures = per.get(name) or {}
        exposed, estimated = exposed_comm(name, c["profile"], local_profile)
        sent = figures.get("tx_bytes_per_step")
        c.update({
            "link_tx_bytes_per_step": sent,
            "link_rx_bytes_per_step": figures.get("rx_bytes_per_step"),
            "link_tx_bytes_per_step_hosts": figures.get("tx_bytes_per_step_hosts"),
            "link_rx_bytes_per_step_hosts": figures.get("rx_bytes_per_step_hosts"),
            "link_bytes_vs_ddp": sent / ddp_sent if sent is not None and ddp_sent else None,
            "exposed_comm_ms": exposed, "exposed_comm_estimated": estimated,
            "exposed_comm_vs_link_floor": exposed / floor_ms if exposed is not None and floor_ms else None,
        })


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


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench train", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated models among {', '.join(SPECS)} (default {DEFAULT_MODELS})")
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round (default 5)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--batch-size", type=int, default=0, help="per-rank batch size (default: per model)")
    parser.add_argument("--distinct-batches", type=int, default=4, help="synthetic batches cycled (default 4)")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="steps of the instrumented block that splits the step time (default 5; 0 = none)")
    parser.add_argument("--dist", action="append", default=[], metavar="OPTION=VALUE",
                        help="a dist option of hpcnet's contender (e.g. progress=thread; repeatable; default: "
                             "hpcnet's defaults, as training uses)")
    parser.add_argument("--cuda", action="append", default=[], metavar="OPTION=VALUE",
                        help="a cuda option for every contender (e.g. channels_last=off; repeatable; default: "
                             "hpcnet's defaults, on for a CUDA device)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="train.precision of every contender's forward (default fp32)")
    parser.add_argument("--ddp-hooks", default="", metavar="HOOK,...",
                        help=f"also DDP with these communication hooks, each a contender: {', '.join(DDP_HOOKS)} "
                             f"(PowerSGD at rank {POWERSGD_RANK}; default none)")
    parser.add_argument("--no-local", action="store_true", help="leave out the no-communication baseline")
    parser.add_argument("--link-gbit", type=float, default=None, metavar="G",
                        help="the rate of each host's link in Gbit/s, for the link floor (default: the slowest "
                             "host's link as the topology probe measures it, on more than one host; the interfaces' "
                             "nominal /sys/class/net/<if>/speed is shown beside it, never used: a tc rate limit "
                             "does not show there)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "distinct_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.profile_steps < 0 or args.batch_size < 0:
        parser.error("--warmup, --profile-steps and --batch-size must be >= 0")
    if args.link_gbit is not None and not 0 < args.link_gbit < float("inf"):  # NaN too
        parser.error("--link-gbit must be a positive number of Gbit/s")
    from hpcnet.config.load import load_config
    from hpcnet.errors import UsageError

    try:
        args.dist_cfg = load_config(overrides=[f"dist.{o}" for o in args.dist]).dist
    except UsageError as exc:
        parser.error(f"--dist: {exc}")
    try:
        args.cuda_cfg = load_config(overrides=[f"cuda.{o}" for o in args.cuda]).cuda
    except UsageError as exc:
        parser.error(f"--cuda: {exc}")
    args.hook_list = tuple(h.strip() for h in args.ddp_hooks.split(",") if h.strip())
    odd = [h for h in args.hook_list if h not in DDP_HOOKS]
    if odd:
        parser.error(f"--ddp-hooks: unknown hook(s) {', '.join(odd)}; choose among {', '.join(DDP_HOOKS)}")
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_list if m not in SPECS]
    if unknown or not args.model_list:
        parser.error(f"unknown model(s) {', '.join(unknown) or '(none given)'}; choose among {', '.join(SPECS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench train``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.agree import shared_errors
    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import choose_device, cpu_threads, discover

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    torch.set_num_threads(cpu_threads(world))  # as hpcnet.train does: the node's cores shared among its ranks
    with shared_errors(comm):
        device = choose_device(world)
    env = environment(comm)
    if world.is_main:
        print(describe_environment(env), flush=True)
    backend = "nccl" if device.type == "cuda" else "gloo"  # DDP and the raw peers run on it
    plane = init_data_plane(comm, world, backend=backend, device=device, timeout_s=300.0)
    try:
        measured = None if args.link_gbit else probe_link_gbit(comm, world)  # the floor's rate, before any model
        results = []
        for name in args.model_list:
            t0 = time.perf_counter()
            res = bench_model(name, SPECS[name], comm, world, args, device, measured)
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            if world.is_main:
                print()
                print(format_model(res), flush=True)
        env["load_average_end"] = load_average()
        if world.is_main:
            print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in env['load_average_end'])}")
            if args.json:
                write_json(args.json, {"benchmark": "train", "environment": env, "results": results})
        return 0
    finally:
        plane.close()
        comm.Free()
