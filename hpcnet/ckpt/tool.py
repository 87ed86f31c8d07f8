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
against the file before anything is allocated, and links or storage outside the file are refused) or could not
be read, 2 a bad path or argument.

A run may be saving into the directory meanwhile and pruning it: a checkpoint deleted between the listing and its
reading is passed over, and the directory listed again (``_despite_pruning``).
"""

import argparse
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hpcnet.errors import USAGE_ERRNOS, CheckpointCorrupt, ExitCode, UsageError, errno_of, error_text
from hpcnet.paths import file_kind

if TYPE_CHECKING:
    from hpcnet.ckpt.schema import CheckpointInfo

T = TypeVar("T")

PRUNE_TRIES = 5
"""How many times a command lists a directory afresh when a checkpoint it was reading has been deleted (pruned by
the run saving there), before it gives up."""


def _check_path(path: Path) -> None:
    """A checkpoint directory or file: never a FIFO or a device, which opening could wait on forever."""
    kind = file_kind(path)
    if kind == "missing":
        raise UsageError(f"{str(path)!r} does not exist")
    if kind not in ("file", "directory"):
        raise UsageError(f"{str(path)!r} is a {kind}, not a checkpoint file or directory")


def _despite_pruning(path: Path, read: Callable[[], T], out: Any | None) -> T:
    """``read()`` of the checkpoint(s) at ``path``, again from a fresh listing whenever it failed because a file it
    had listed was deleted: a run saving into the directory prunes its oldest checkpoints, and with a small
    ``checkpoint.keep`` the newest of a moment ago may be among them.  ``out`` (None: nowhere) is told.

    Raises:
        UsageError: in one line, when ``path`` itself (a file) was deleted, or the reads kept losing their files;
            the last error of ``read()`` itself when it kept failing otherwise.
    """
    from hpcnet.ckpt.listing import listing

    folder = path if path.is_dir() else path.parent
    last: Exception | None = None
    for _ in range(PRUNE_TRIES):
        before = {name for name, _ in listing(folder)}
        try:
            return read()
        except (FileNotFoundError, UsageError) as exc:  # a listed file gone, or a chain broken by it
            gone = sorted(before - {name for name, _ in listing(folder)})
            if not gone and not isinstance(exc, FileNotFoundError):
                raise  # nothing was deleted: the error is the checkpoint's own
            if not path.is_dir() and not path.exists():
                raise UsageError(f"{str(path)!r} was deleted while it was read (pruned by the run that saves "
                                 "there?)") from None
            if out is not None:
                print(f"({', '.join(gone) or 'a checkpoint'} was deleted while it was read, pruned by the run that "
                      "saves there: listing the directory again)", file=out)
            last = exc
    if isinstance(last, UsageError):
        raise last  # damage, say, that files deleted meanwhile did not explain
    raise UsageError(f"the checkpoints of {str(folder)!r} were deleted while they were read, {PRUNE_TRIES} times "
                     "over: the run saving there prunes them faster than they can be read (copy one elsewhere "
                     "first, or raise its checkpoint.keep)")


def _scan(directory: Path) -> tuple[list["CheckpointInfo"], list[Path]]:
    """``scan(directory)``, again while checkpoints are deleted during it: a scan skips a file deleted before it
    opened it, and one that lost them all would show none of the files a directory that is being pruned always
    holds."""
    from hpcnet.ckpt.listing import listing, scan

    for _ in range(PRUNE_TRIES):
        before = {name for name, _ in listing(directory)}
        found = scan(directory)
        if not before - {name for name, _ in listing(directory)}:
            break
    return found


def _targets(path: Path) -> list[Path]:
    if path.is_dir():
        targets = [Path(i.path) for i in _scan(path)[0]]
        if not targets:
            raise UsageError(f"no checkpoints in {str(path)!r}")
        return targets
    if path.exists():
        return [path]
    raise UsageError(f"{str(path)!r} does not exist")


def _size_mb(path: str | Path) -> float | None:
    """The size of a listed file in MB; None when it has been deleted since (pruned, or a save committed)."""
    try:
        return os.path.getsize(path) / 1e6
    except FileNotFoundError:
        return None


def cmd_list(path: Path, out: Any) -> int:
    from hpcnet.ckpt.listing import read_info

    infos, stale = _scan(path) if path.is_dir() else ([read_info(path)], []) if path.exists() else (None, None)
    if infos is None:
        raise UsageError(f"{str(path)!r} does not exist")
    print(f"{'step':>10}  {'kind':<11}  {'MB':>9}  {'ranks':>5}  {'file':<20}  base / problem", file=out)
    for info in infos:
        if (size_mb := _size_mb(info.path)) is None:
            continue
        note = info.error if info.error else (info.base or "")
        print(f"{info.step:>10}  {info.kind:<11}  {size_mb:>9.2f}  {info.world_size:>5}  {info.name:<20}  {note}",
              file=out)
    for tmp in stale:
        if (size_mb := _size_mb(tmp)) is not None:
            print(f"{'':>10}  {'uncommitted':<11}  {size_mb:>9.2f}  {'':>5}  {tmp.name}  "
                  "(a save that did not finish; never loaded)", file=out)
    if not infos and not stale:
        print(f"(no checkpoints in {path})", file=out)
    return 0


def _read_newest_header(path: Path) -> tuple[Path, int, dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The newest checkpoint at ``path``: its path, size in bytes, attributes, index and meta."""
    from hpcnet.ckpt.validate import open_read, read_header, read_json

    target = _targets(path)[-1]
    size = os.path.getsize(target)
    try:
        with open_read(target) as f:
            attrs, index = read_header(f, target)
            meta = read_json(f, "meta", attrs["meta_sha256"])
    except FileNotFoundError:
        raise  # deleted since the listing
    except (OSError, ValueError) as exc:
        raise UsageError(f"{str(target)!r} is not a readable hpcnet checkpoint: {exc}") from None
    return target, size, attrs, index, meta


def cmd_inspect(path: Path, out: Any) -> int:
    from hpcnet.ckpt.listing import scan
    from hpcnet.ckpt.schema import resolve_chain

    target, size, attrs, index, meta = _despite_pruning(path, lambda: _read_newest_header(path), out)
    print(f"file: {target}  ({size / 1e6:.2f} MB)", file=out)
    for key, value in attrs.items():
        print(f"  {key}: {value}", file=out)
    infos = scan(target.parent)[0]
    info = next((i for i in infos if Path(i.path) == target), None)
    if info is None:
        print("chain: (the file has been deleted since it was read)", file=out)
    else:
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
    failed = gone = 0
    for target in targets:
        try:
            loaded = _despite_pruning(target, partial(load_checkpoint, MPI.COMM_SELF, str(target)), None)
        except UsageError as exc:
            if not target.exists():
                gone += 1
                print(f"gone   {target.name}: deleted since the listing (pruned by the run that saves there)",
                      file=out)
                continue
            failed += 1
            print(f"FAILED {target.name}: {exc}", file=out)
        else:
            assert loaded is not None
            size = sum(t.numel() * t.element_size() for t in loaded.tensors.values())
            print(f"ok     {target.name}: step {loaded.step}, {len(loaded.tensors)} tensors, {size / 1e6:.2f} MB",
                  file=out)
    if gone == len(targets):
        raise UsageError(f"nothing verified: each of the {gone} checkpoint(s) listed in {str(path)!r} was deleted "
                         "before it was read (the run saving there prunes them faster than they can be read)")
    return 1 if failed else 0


def cmd_export(path: Path, output: str | None, out: Any, fmt: str = "pt", hf_config: str | None = None,
               optimizer: bool = False) -> int:
    from mpi4py import MPI

    from hpcnet.ckpt import export
    from hpcnet.ckpt.load import load_checkpoint

    if fmt not in export.FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(export.FORMATS)}")
    if hf_config and fmt != "hf":
        raise UsageError("--hf-config is for --format hf only")
    if optimizer and fmt != "pt":
        raise UsageError(f"--optimizer is for --format pt only: a {fmt} export holds the model, for readers that "
                         "load it strictly")
    loaded = _despite_pruning(path, lambda: load_checkpoint(MPI.COMM_SELF, str(path)), out)
    assert loaded is not None
    # Before the tensors are joined: a run without model.hf fails at once.
    hf, options = export.run_model_config(loaded.meta, repr(str(loaded.path))) if fmt == "hf" else ("", {})
    from hpcnet.ckpt.schema import join_pieces  # a dist.zero=3 checkpoint's cut parameters are in row pieces

    joined = join_pieces(loaded.tensors)
    state = {k.removeprefix("model/"): v.clone() for k, v in joined.items() if k.startswith("model/")}
    if not state:
        raise UsageError(f"{str(loaded.path)!r} holds no model/ tensors")
    saved: Any = state
    if optimizer:
        saved = {"model": state, **_optimizer_export(joined, loaded.meta, str(loaded.path))}
    target = Path(output) if output else Path(loaded.path.stem + export.SUFFIXES[fmt])
    source = f"from {loaded.path} (step {loaded.step})"
    try:
        if fmt == "pt":
            export.write_pt(saved, target)
            how = (f"state_dict of {len(state)} tensors {source}" if saved is state else
                   f"'model' (a state_dict of {len(state)} tensors) and {saved['optimizer_class']}'s 'optimizer' "
                   f"(its state_dict) {source}") + f"; read it with torch.load({str(target)!r}, weights_only=True)"
        elif fmt == "safetensors":
            export.write_safetensors(state, target, {"hpcnet_checkpoint": loaded.path.name,
                                                     "hpcnet_step": str(loaded.step)})
            how = f"state_dict of {len(state)} tensors {source}; read it with " \
                  f"safetensors.torch.load_file({str(target)!r})"
        else:
            name, left_out = export.write_hf(state, hf_config or hf, options, target,
                                             {"checkpoint": str(loaded.path), "step": loaded.step})
            how = f"{name} {source}; load it with {name}.from_pretrained({str(target)!r})"
            how += "".join(f"\n  {note}" for note in left_out)
    except OSError as exc:
        raise UsageError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    except (UsageError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - torch's and safetensors' own errors of a failed write (a full disk)
        raise UsageError(f"cannot write {str(target)!r}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                         ) from None
    print(f"wrote {target}: {how}", file=out)
    return 0


def _optimizer_export(joined: dict[str, Any], meta: dict[str, Any], source: str) -> dict[str, Any]:
    """``--optimizer``: the checkpoint's optimizer state as the unsharded optimizer's state_dict, and its class."""
    from hpcnet.ckpt.parts import full_optimizer_state

    saved = meta.get("state")
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise UsageError(f"{source!r} holds no optimizer state")
    return {"optimizer": full_optimizer_state(joined, saved), "optimizer_class": saved.get("optimizer")}


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
            p.add_argument("--optimizer", action="store_true",
                           help="pt: also the optimizer's state, unsharded: {'model': state_dict, 'optimizer': the "
                                "optimizer's state_dict, 'optimizer_class': its class's name} (left out by default)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        _check_path(path)
        if args.command == "list":
            return cmd_list(path, out)
        if args.command == "inspect":
            return cmd_inspect(path, out)
        if args.command == "verify":
            return cmd_verify(path, out)
        return cmd_export(path, args.output, out, args.format, args.hf_config, args.optimizer)
    except CheckpointCorrupt as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(ExitCode.CODE_ERROR)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR)
    except OSError as exc:  # reading a checkpoint: a permission is the user's to fix, an I/O error the storage's
        print(f"error: {error_text(exc)}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR if errno_of(exc) in USAGE_ERRNOS else ExitCode.CODE_ERROR)
