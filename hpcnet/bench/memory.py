"""Memory per rank of hpcnet's dist.zero=0/1/2 against torch DDP and DDP with ZeroRedundancyOptimizer, same run.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.bench memory [--models mlp-4096] [--optim adamw] [--json out.json]

Every contender trains its own copy of one model (same weights, same AdamW or SGD settings, same synthetic
batches) for a few steps, one contender after the other in the same processes. For each, every rank measures
its resident memory (``/proc/self/status``) above what it held before the contender was built: ``held`` after
the steps (what stays between steps: parameters, gradients, optimizer state, communication buffers) and
``peak`` during them (the high-water mark, reset with ``/proc/self/clear_refs`` before each contender; it adds
activations and the transient full gradient). The table gives the largest rank's figures and their ratio to
DDP's. For hpcnet the tensors themselves are counted as well (parameters, gradients and buckets, optimizer
state), which is exact where resident memory is approximate (glibc keeps small freed blocks).
"""

import argparse
import copy
import ctypes
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcnet.bench.common import describe_environment, environment, load_average, table, write_json

MODELS = {
    # GPT-style, 8 blocks of width 512, vocabulary 8192 (tied): 29.4 M parameters (112 MiB), in 100 tensors.
    "transformer": ("transformer", {"d_model": 512, "n_layers": 8, "n_heads": 8}, "tokens", (64,), 8192, 4),
    # 29.4 M parameters in 6 tensors, two of them 43% and 57% of the bytes: whole tensors cannot be balanced.
    "mlp-4096": ("mlp", {"hidden": [4096, 4096]}, "image", (3, 32, 32), 10, 8),
    # A seconds-long smoke test.
    "mlp-small": ("mlp", {"hidden": [256, 256]}, "image", (3, 32, 32), 10, 8),
}
CONTENDERS = ("ddp", "ddp+torch-zero1", "hpcnet-zero0", "hpcnet-zero1", "hpcnet-zero2")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _settle() -> int:
    """Resident KiB after returning freed memory to the OS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status_kib("VmRSS")


M_MMAP_THRESHOLD = -3


def _fixed_mmap_threshold() -> None:
    """Every allocation of 128 KiB or more gets its own mapping, returned to the OS when freed: glibc otherwise
    raises the threshold after a large block is freed, later tensors come from its heap, and resident memory
    then keeps what earlier contenders freed (seen here: stage 1 'holding' as much as stage 0)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one bucket count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _hpcnet_tensors(model: nn.Module, dp: Any, optimizer: Any) -> dict[str, int]:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in dp.reducer.buckets:
        grads.append(bucket.buffer)
        if bucket.owned is not None:
            grads.append(bucket.owned)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optim": _storage_bytes(state)}


def _build(name: str, base: nn.Module, comm: Any, world: Any, optim: str) -> tuple[nn.Module, Any, Any, Any]:
    """The contender's model, its forward module, its optimizer and hpcnet's DataParallel (or None)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from hpcnet.comm.dataparallel import DataParallel
    from hpcnet.comm.plan import decide_plan
    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.optim import build_optimizer

    optim_cfg = OptimConfig(name=optim, lr=1e-3)
    model = copy.deepcopy(base)
    if name.startswith("hpcnet"):
        cfg = DistConfig(zero=int(name[-1]), plan="uniform")
        dp = DataParallel(model, comm, world, cfg, device=torch.device("cpu"),
                          plan=decide_plan(comm, world, cfg, device_type="cpu"))
        return model, model, dp.shard_optimizer(build_optimizer(model, optim_cfg)), dp
    ddp = DistributedDataParallel(model)
    if name == "ddp":
        return model, ddp, build_optimizer(model, optim_cfg), None
    groups = build_optimizer(model, optim_cfg).param_groups
    cls = torch.optim.AdamW if optim == "adamw" else torch.optim.SGD
    extra = {"betas": tuple(optim_cfg.betas), "eps": optim_cfg.eps} if optim == "adamw" else \
        {"momentum": optim_cfg.momentum}
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, lr=optim_cfg.lr,
                                   weight_decay=groups[0]["weight_decay"], process_group=dist.group.WORLD, **extra)
    zero.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
    return model, ddp, zero, None


def _steps(model: nn.Module, forward: Any, optimizer: Any, dp: Any, batches: list, steps: int) -> None:
    from hpcnet.loop import compute_loss

    for step in range(steps):
        x, y = batches[step % len(batches)]
        if dp is not None:
            dp.step([(x, y)], compute_loss)
            dp.clip_grad_norm_(1.0)
        else:
            optimizer.zero_grad(set_to_none=True)
            compute_loss(forward, x, y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def bench_model(key: str, comm: Any, world: Any, args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    model_name, options, kind, shape, classes, batch = MODELS[key]
    torch.manual_seed(0)
    base = build_model(model_name, DatasetInfo(kind, shape, classes), options)
    gen = torch.Generator().manual_seed(100 + world.rank)
    if kind == "tokens":
        batches = [(torch.randint(0, classes, (batch, *shape), generator=gen),
                    torch.randint(0, classes, (batch, *shape), generator=gen)) for _ in range(2)]
    else:
        batches = [(torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
                   for _ in range(2)]
    n_params = sum(p.numel() for p in base.parameters())
    results: dict[str, Any] = {}
    finals = {}
    # One unmeasured step of each kind first: what the first use of autograd, gloo and MPI allocates for good
    # would otherwise be charged to the first contender.
    for name in ("ddp", "hpcnet-zero2"):
        model, forward, optimizer, dp = _build(name, base, comm, world, args.optim)
        _steps(model, forward, optimizer, dp, batches, 1)
        if dp is not None:
            dp.close()
        del model, forward, optimizer, dp
    for name in CONTENDERS:
        before = _settle()
        comm.Barrier()
        _reset_peak()
        model, forward, optimizer, dp = _build(name, base, comm, world, args.optim)
        _steps(model, forward, optimizer, dp, batches, args.steps)
        gc.collect()
        held, peak = _status_kib("VmRSS") - before, _status_kib("VmHWM") - before
        counted = _hpcnet_tensors(model, dp, optimizer) if dp is not None else None
        finals[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = comm.gather((held, peak, counted), root=0)
        if world.rank == 0:
            results[name] = {"held_mib": [h / 1024 for h, _, _ in every], "peak_mib": [p / 1024 for _, p, _ in every],
                             "tensors_mib": [{k: v / 2**20 for k, v in c.items()} if c else None
                                             for _, _, c in every]}
        if dp is not None:
            dp.close()
        del model, forward, optimizer, dp
        comm.Barrier()
    # The contenders trained alike: their weights agree (hpcnet's stages bit for bit up to 2 ranks).
    ref = finals["hpcnet-zero0"]
    diffs = {name: float((w - ref).abs().max()) for name, w in finals.items()}
    worst = comm.allreduce(max(diffs.values()), op=MPI.MAX)
    if world.rank == 0:
        return {"model": key, "parameters": n_params, "optimizer": args.optim, "contenders": results,
                "max_weight_difference": worst, "differences": diffs}
    return {}


def report(out: dict[str, Any]) -> str:
    rows = []
    res = out["contenders"]
    ddp_held, ddp_peak = max(res["ddp"]["held_mib"]), max(res["ddp"]["peak_mib"])
    for name, r in res.items():
        held, peak = max(r["held_mib"]), max(r["peak_mib"])
        tensors = [t for t in r["tensors_mib"] if t]
        counted = (" / ".join(f"{max(t[k] for t in tensors):.1f}" for k in ("params", "grads", "optim"))
                   if tensors else "-")
        rows.append([name, f"{held:.1f}", f"{held / ddp_held:.2f}", f"{peak:.1f}", f"{peak / ddp_peak:.2f}", counted])
    head = (f"{out['model']}: {out['parameters'] / 1e6:.1f} M parameters ({out['parameters'] * 4 / 2**20:.0f} MiB "
            f"in fp32), {out['optimizer']}")
    return (head + "\n" + table(["contender", "held MiB", "/ddp", "peak MiB", "/ddp",
                                  "hpcnet tensors MiB: params / grads+buckets / optim"], rows)
            + "\nheld: resident memory after the steps above what the rank held before the contender was built; "
              "peak: its high-water mark during them; both the largest rank's. "
            + f"max |weight difference| between contenders after the steps: {out['max_weight_difference']:.2e}")


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.comm.world import discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,mlp-4096",
                        help=f"comma-separated among {', '.join(MODELS)} (default transformer,mlp-4096)")
    parser.add_argument("--optim", default="adamw", choices=["adamw", "sgd"], help="the optimizer (default adamw)")
    parser.add_argument("--steps", type=int, default=3, help="steps per contender (default 3)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown or args.models!r}; choose among {', '.join(MODELS)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    if world.size < 2:
        parser.error("run it with at least 2 ranks (mpirun -np 2 ...): memory is saved by sharding over ranks")
    torch.set_num_threads(1)
    _fixed_mmap_threshold()
    plane = init_data_plane(comm, world, backend="gloo", device=torch.device("cpu"), timeout_s=300)
    env = environment(comm)
    outs = []
    try:
        for key in models:
            out = bench_model(key, comm, world, args)
            if world.rank == 0:
                outs.append(out)
                print(report(out), flush=True)
    finally:
        plane.close()
    if world.rank == 0:
        print(describe_environment(env))
        print(f"load average at end: {', '.join(f'{x:.2f}' for x in load_average())}")
        if args.json:
            write_json(args.json, {"environment": env, "models": outs})
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
