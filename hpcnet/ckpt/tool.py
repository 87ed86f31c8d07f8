"""Inspect, verify and export hpcnet checkpoints from the command line (one process, no mpirun).

    python -m hpcnet.ckpt list    DIR_OR_FILE    committed checkpoints: step, kind, base, size
    python -m hpcnet.ckpt inspect DIR_OR_FILE    one checkpoint (the newest in a directory): attributes, meta, tensors
    python -m hpcnet.ckpt verify  DIR_OR_FILE    read and check every checksum of each checkpoint's chain
    python -m hpcnet.ckpt export  DIR_OR_FILE [--format pt|safetensors|hf] [-o OUT]
                                                 the model for readers without hpcnet or MPI: a state_dict for
                                                 torch.load(OUT, weights_only=True) (pt, the default), one
                                                 .safetensors file, or a directory for from_pretrained (hf: a
                                                 run with model.hf); hpcnet.ckpt.export says what each holds

Exit status: 0 fine, 1 a checkpoint failed verification (damaged, or crafted: declared sizes are checked
against the file before anything is allocated, and links or storage outside the file are refused),
2 a bad path or argument.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hpcnet.errors import CheckpointCorrupt, ExitCode, UsageError


def _targets(path: Path) -> list[Path]:
    from hpcnet.ckpt.listing import scan

    if path.is_dir():
        targets = [Path(i.path) for i in scan(path)[0]]
        if not targets:
            raise UsageError(f"no checkpoints in {str(path)!r}")
        return targets
    if path.exists():
        return [path]
    raise UsageError(f"{str(path)!r} does not exist")


def cmd_list(path: Path, out: Any) -> int:
    from hpcnet.ckpt.listing import read_info, scan

    infos, stale = scan(path) if path.is_dir() else ([read_info(path)], []) if path.exists() else (None, None)
    if infos is None:
        raise UsageError(f"{str(path)!r} does not exist")
    print(f"{'step':>10}  {'kind':<11}  {'MB':>9}  {'ranks':>5}  {'file':<20}  base / problem", file=out)
    for info in infos:
        size_mb = os.path.getsize(info.path) / 1e6
        note = info.error if info.error else (info.base or "")
        print(f"{info.step:>10}  {info.kind:<11}  {size_mb:>9.2f}  {info.world_size:>5}  {info.name:<20}  {note}",
              file=out)
    for tmp in stale:
        print(f"{'':>10}  {'uncommitted':<11}  {os.path.getsize(tmp) / 1e6:>9.2f}  {'':>5}  {tmp.name}  "
              "(a save that did not finish; never loaded)", file=out)
    if not infos and not stale:
        print(f"(no checkpoints in {path})", file=out)
    return 0


def cmd_inspect(path: Path, out: Any) -> int:
    from hpcnet.ckpt.listing import scan
    from hpcnet.ckpt.schema import resolve_chain
    from hpcnet.ckpt.validate import open_read, read_header, read_json

    targets = _targets(path)
    target = targets[-1]
    try:
        with open_read(target) as f:
            attrs, index = read_header(f, target)
            meta = read_json(f, "meta", attrs["meta_sha256"])
    except (OSError, ValueError) as exc:
        raise UsageError(f"{str(target)!r} is not a readable hpcnet checkpoint: {exc}") from None
    print(f"file: {target}  ({os.path.getsize(target) / 1e6:.2f} MB)", file=out)
    for key, value in attrs.items():
        print(f"  {key}: {value}", file=out)
    infos = scan(target.parent)[0]
    info = next((i for i in infos if Path(i.path) == target), None)
    if info is not None:
        try:
            print("chain: " + " -> ".join(i.name for i in resolve_chain(infos, info)), file=out)
        except ValueError as exc:
            print(f"chain: BROKEN ({exc})", file=out)
    print("meta['checkpoint']: " + json.dumps(meta.get("checkpoint"), sort_keys=True), file=out)
    print("meta keys: " + ", ".join(sorted(meta)), file=out)
    stored = "changed blocks" if attrs["kind"] == "incremental" else "blocks"
    print(f"tensors ({len(index)}):", file=out)
    total = 0
    for entry in index:
        spec = entry["spec"]
        total += spec.nbytes
        print(f"  {spec.name:<48} {spec.dtype:<9} {list(spec.shape)!s:<18} {spec.nbytes / 1e6:>10.3f} MB  "
              f"{entry['n_hashes']}/{spec.n_blocks} {stored}", file=out)
    print(f"logical size: {total / 1e6:.2f} MB", file=out)
    return 0


def cmd_verify(path: Path, out: Any) -> int:
    from mpi4py import MPI

    from hpcnet.ckpt.load import load_checkpoint

    targets = _targets(path)
    failed = 0
    for target in targets:
        try:
            loaded = load_checkpoint(MPI.COMM_SELF, str(target))
        except UsageError as exc:
            failed += 1
            print(f"FAILED {target.name}: {exc}", file=out)
        else:
            assert loaded is not None
            size = sum(t.numel() * t.element_size() for t in loaded.tensors.values())
            print(f"ok     {target.name}: step {loaded.step}, {len(loaded.tensors)} tensors, {size / 1e6:.2f} MB",
                  file=out)
    return 1 if failed else 0


def cmd_export(path: Path, output: str | None, out: Any, fmt: str = "pt", hf_config: str | None = None) -> int:
    from mpi4py import MPI

    from hpcnet.ckpt import export
    from hpcnet.ckpt.load import load_checkpoint

    if fmt not in export.FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(export.FORMATS)}")
    if hf_config and fmt != "hf":
        raise UsageError("--hf-config is for --format hf only")
    loaded = load_checkpoint(MPI.COMM_SELF, str(path))
    assert loaded is not None
    # Before the tensors are joined: a run without model.hf fails at once.
    hf, options = export.run_model_config(loaded.meta, repr(str(loaded.path))) if fmt == "hf" else ("", {})
    from hpcnet.ckpt.state import join_pieces  # a dist.zero=3 checkpoint's cut parameters are in row pieces

    state = {k.removeprefix("model/"): v.clone() for k, v in join_pieces(loaded.tensors).items()
             if k.startswith("model/")}
    if not state:
        raise UsageError(f"{str(loaded.path)!r} holds no model/ tensors")
    target = Path(output) if output else Path(loaded.path.stem + export.SUFFIXES[fmt])
    source = f"from {loaded.path} (step {loaded.step})"
    try:
        if fmt == "pt":
            export.write_pt(state, target)
            how = f"state_dict of {len(state)} tensors {source}; read it with torch.load({str(target)!r}, " \
                  "weights_only=True)"
        elif fmt == "safetensors":
            export.write_safetensors(state, target, {"hpcnet_checkpoint": loaded.path.name,
                                                     "hpcnet_step": str(loaded.step)})
            how = f"state_dict of {len(state)} tensors {source}; read it with " \
                  f"safetensors.torch.load_file({str(target)!r})"
        else:
            name = export.write_hf(state, hf_config or hf, options, target,
                                   {"checkpoint": str(loaded.path), "step": loaded.step})
            how = f"{name} {source}; load it with {name}.from_pretrained({str(target)!r})"
    except OSError as exc:
        raise UsageError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    except (UsageError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - torch's and safetensors' own errors of a failed write (a full disk)
        raise UsageError(f"cannot write {str(target)!r}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                         ) from None
    print(f"wrote {target}: {how}", file=out)
    return 0


def main(argv: list[str] | None = None, out: Any = None) -> int:
    from hpcnet.ckpt.export import FORMATS  # torch-free, as this module

    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m hpcnet.ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "inspect", "verify", "export"):
        p = sub.add_parser(name)
        p.add_argument("path", help="a checkpoint directory or file")
        if name == "export":
            p.add_argument("--format", default="pt", choices=FORMATS,
                           help="pt: a torch.save'd state_dict (default); safetensors: the state_dict in one "
                                ".safetensors file; hf: a directory for from_pretrained (a run with model.hf)")
            p.add_argument("-o", "--output", help="output file, or directory for hf (default: <checkpoint name>.pt, "
                                                  ".safetensors or -hf here); an earlier export there is replaced")
            p.add_argument("--hf-config", help="hf: the config.json or model directory to rebuild the model from, "
                                               "instead of the run's model.hf (moved, or relative to elsewhere)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        if args.command == "list":
            return cmd_list(path, out)
        if args.command == "inspect":
            return cmd_inspect(path, out)
        if args.command == "verify":
            return cmd_verify(path, out)
        return cmd_export(path, args.output, out, args.format, args.hf_config)
    except CheckpointCorrupt as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(ExitCode.CODE_ERROR)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR)
