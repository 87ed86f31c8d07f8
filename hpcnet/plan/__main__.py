"""``python -m hpcnet.plan [--ranks N] [--cap-gb X] [--config FILE] [option=value ...]``: each rank's predicted peak
memory for every ``dist.zero`` stage and activation checkpointing choice of a run, without training.

The options are ``python -m hpcnet.train``'s (the model, the dataset, ``train.batch_size``, ``optim.*``,
``train.precision``); one step of the model is measured in this process at one rank's batch (see
``hpcnet.plan.peaks``).  With ``--cap-gb`` (or ``dist.memory_cap_gb``) it also prints the choice a run with that
cap makes, or the error it stops with.  Status 0, or 2 on bad input or when nothing fits.

Example::

    python -m hpcnet.plan --ranks 4 --cap-gb 0.5 model.name=transformer data.dataset=synthetic-tokens \\
        model.options.d_model=512 model.options.n_layers=8 optim.name=adamw
"""

import argparse
import json
import sys
from pathlib import Path

from hpcnet.errors import ExitCode, UsageError

MAX_RANKS = 2**20
"""The most ``--ranks`` the planner takes: its owner plan is per rank (about 9 s and 0.5 GB at 2^20 ranks here, 37 s
and 1.6 GB at 10^7), and more than any data-parallel job runs."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.plan", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1, help="ranks of the run (default 1)")
    parser.add_argument("--cap-gb", type=float, default=None,
                        help="memory per rank, GB (1e9 bytes); default dist.memory_cap_gb, none when 0")
    parser.add_argument("--config", default=None, help="a TOML configuration, as python -m hpcnet.train takes")
    parser.add_argument("--json", default="", help="also write the predictions to this file")
    parser.add_argument("overrides", nargs="*", help="options, e.g. model.name=transformer train.batch_size=8")
    args = parser.parse_args(argv)
    if not 1 <= args.ranks <= MAX_RANKS:
        parser.error(f"--ranks must be from 1 to {MAX_RANKS}, got {args.ranks}")
    if args.cap_gb is not None and not args.cap_gb > 0:
        parser.error(f"--cap-gb must be a positive number of GB, got {args.cap_gb}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        return _plan(args)
    except UsageError as exc:  # ConfigError is one
        print(f"hpcnet.plan: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE_ERROR


def _plan(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    from hpcnet.config.load import load_config
    from hpcnet.data.loader import open_dataset
    from hpcnet.models import build_from_config, count_parameters
    from hpcnet.plan.measure import measure_config
    from hpcnet.plan.peaks import cap_in_bytes, choose, configured_bucket_bytes, predictions

    overrides = args.overrides + ([f"dist.memory_cap_gb={args.cap_gb}"] if args.cap_gb is not None else [])
    cfg = load_config(args.config, overrides)
    cap = args.cap_gb if args.cap_gb is not None else (cfg.dist.memory_cap_gb or None)
    split = open_dataset(cfg.data.dataset, "train", directory=cfg.data.dir, comm=MPI.COMM_SELF,
                         options=cfg.data.options, seed=cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_from_config(cfg.model, split.info)  # as training builds it
    memory = measure_config(cfg, model, split)
    bucket = configured_bucket_bytes(cfg.dist)
    every = predictions(memory, ranks=args.ranks, bucket_bytes=bucket)
    print(f"model {cfg.model.describe()}: {count_parameters(model):,} parameters "
          f"({memory.param_bytes / 1e9:.3f} GB), blocks {100 * memory.block_share:.0f}% of them; "
          f"{args.ranks} ranks, train.batch_size={cfg.train.batch_size}, optim.name={cfg.optim.name}, "
          f"train.precision={cfg.train.precision}")
    print(f"{'dist.zero':>9}  {'checkpointing':>13}  {'peak GB':>8}  {'at':>9}  {'params':>7}  {'grads':>7}  "
          f"{'optim':>7}  {'step':>7}  {'step ms':>8}")
    for p in sorted(every, key=lambda p: (p.checkpointing, p.stage)):
        print(f"{p.stage:>9}  {p.checkpointing:>13}  {p.peak / 1e9:8.3f}  {p.phase:>9}  {p.params / 1e9:7.3f}  "
              f"{p.grads / 1e9:7.3f}  {p.optimizer / 1e9:7.3f}  {p.transient / 1e9:7.3f}  {p.step_s * 1e3:8.1f}")
    chosen, failure = None, None
    if cap:
        try:
            chosen = choose(memory, ranks=args.ranks, cap_bytes=cap_in_bytes(cap), bucket_bytes=bucket,
                            option="--cap-gb" if args.cap_gb is not None else "dist.memory_cap_gb",
                            checkpointing=cfg.train.activation_checkpointing)
            print(f"under {cap:g} GB a rank, train.activation_checkpointing={cfg.train.activation_checkpointing}: "
                  f"{chosen.describe()} (the fastest that fits; dist.memory_cap_gb={cap:g} makes a run choose it)")
        except UsageError as exc:
            failure = str(exc)
    if args.json:
        _write_json(args.json, {
            "ranks": args.ranks, "cap_gb": cap, "param_bytes": memory.param_bytes,
            "block_share": memory.block_share, "predictions": [p.to_json() for p in every],
            "chosen": chosen.to_json() if chosen else None, "error": failure})
    if failure:
        raise UsageError(failure)
    return ExitCode.OK


def _write_json(path: str, record: dict) -> None:
    """``--json PATH``: the record, or a UsageError naming the option and the file when it cannot be written."""
    try:
        Path(path).write_text(json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        raise UsageError(f"--json {path}: cannot write it: {exc.strerror or exc}") from None


if __name__ == "__main__":
    sys.exit(main())
