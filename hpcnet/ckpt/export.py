"""What ``python -m hpcnet.ckpt export --format pt|safetensors|hf`` writes: a checkpoint's model for readers
without hpcnet or MPI.

- ``pt``: the state dict, ``torch.save``'d (``torch.load(OUT, weights_only=True)``).
- ``safetensors``: the state dict in one ``.safetensors`` file, every key of it
  (``safetensors.torch.load_file(OUT)`` then ``load_state_dict(strict=True)``).  A tied weight is stored
  under each of its names: safetensors refuses tensors that share memory, and a reader of the plain file
  knows nothing of ties, so each name gets its own copy.
- ``hf``: a directory that ``AutoModelFor...from_pretrained(OUT)`` loads: the model rebuilt from the run's
  ``model.hf`` config (with its ``model.options``), the state loaded strictly, then ``save_pretrained``
  (config.json, model.safetensors, transformers' own handling of ties), and the tokenizer files of the
  ``model.hf`` directory, if any: regular files only, never through a link, and no more readable than they are.

A file is written under a temporary name and renamed into place; an hf directory's files are written into a
staging folder inside it and renamed into it one by one, replacing an earlier export's in place, so the directory
stays the one a shell (``-o .``) is in, and a failure puts the earlier export's files back.  An output that is
neither a regular file nor a directory (a FIFO, a device) is refused.  Reference: docs/checkpoints.md.
"""

import errno
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from hpcnet.ckpt.durable import fsync_path
from hpcnet.errors import ConfigError, UsageError
from hpcnet.paths import file_kind

FORMATS = ("pt", "safetensors", "hf")
SUFFIXES = {"pt": ".pt", "safetensors": ".safetensors", "hf": "-hf"}
"""The default output: the checkpoint's name with this suffix, here."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "vocab.txt")
"""Copied from a ``model.hf`` directory into an hf export, so AutoTokenizer loads from it too."""
HF_OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                   "hpcnet-export.json", *TOKENIZER_FILES)
"""What an hf export holds: an existing output directory with nothing else is a previous export, replaced."""


def _check_file_target(target: Path) -> None:
    """A file export replaces a regular file or writes a new one: never a directory, a FIFO or a device (as root,
    ``-o /dev/null`` would otherwise replace the system's)."""
    kind = file_kind(target)
    if kind == "directory":
        raise UsageError(f"-o {str(target)!r} is a directory; --format pt and safetensors write a file")
    if kind not in ("file", "missing"):
        raise UsageError(f"-o {str(target)!r} is a {kind}, not a regular file: an export replaces only a regular "
                         "file, or writes a new one")


def _write_file(target: Path, write: Any) -> None:
    """``write(tmp)`` to a temporary name beside ``target``, then renamed into place; nothing is left of a failed
    write (a full disk), and ``target`` keeps what it held.  The temporary file is created first, exclusively and
    never through a link, under a name nobody can guess (the directory may be writable by others)."""
    _check_file_target(target)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_pt(state: dict[str, Any], target: Path) -> None:
    """``torch.save(state)`` to ``target``, atomically."""
    import torch

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)
    _write_file(target, write)


def unaliased(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``state`` with every tensor that shares memory with an earlier one copied, contiguous; and the copied
    keys.  safetensors refuses aliased tensors (a tied weight under two names)."""
    seen: set[tuple[int, int]] = set()
    out, copied = {}, []
    for key, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if tensor.numel() and storage in seen:
            tensor = tensor.clone()
            copied.append(key)
        elif tensor.numel():
            seen.add(storage)
        out[key] = tensor.contiguous()
    return out, copied


def write_safetensors(state: dict[str, Any], target: Path, metadata: dict[str, str]) -> None:
    """``state`` as one ``.safetensors`` file, every key, atomically; ``metadata`` goes in its header."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise UsageError(f"--format safetensors needs the safetensors package: pip install 'hpcnet[hf]' ({exc})"
                         ) from None
    tensors, _ = unaliased(state)
    umask = os.umask(0)
    os.umask(umask)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
        os.chmod(tmp, 0o666 & ~umask)  # the library creates it 0600; others read what torch.save writes
    _write_file(target, write)


def run_model_config(meta: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """``(model.hf, model.options)`` of the run that saved a checkpoint (its meta's resolved config).

    Raises:
        UsageError: the checkpoint holds no run config, or its run did not train a model.hf.
    """
    model = (meta.get("config") or {}).get("model")
    if not isinstance(model, dict):
        raise UsageError(f"--format hf: {source} holds no run config (not saved by python -m hpcnet.train): "
                         "export --format safetensors or pt instead")
    if not model.get("hf"):
        built = f"model.factory={model['factory']!r}" if model.get("factory") else f"model.name={model.get('name')!r}"
        raise UsageError(f"--format hf needs a run with model.hf (a Hugging Face model); {source} trained "
                         f"{built}: export --format safetensors (or pt) instead")
    return str(model["hf"]), dict(model.get("options") or {})


STAGING_PREFIX = ".hpcnet-export-"
"""Inside an hf output directory while it is written: the new files (``new-``), then the earlier export's (``old-``)."""
EXPORT_MARKER = "hpcnet-export.json"
"""The file an hf export writes beside the model (what it was exported from): a directory is replaced only when it
holds one, an earlier export (so never a model a user wrote, nor the run's own ``model.hf`` directory)."""


def _check_hf_target(target: Path, source: Path | None) -> None:
    kind = file_kind(target)
    if kind == "missing":
        return
    if kind != "directory":
        raise UsageError(f"-o {str(target)!r} is a {kind}, not a directory: --format hf writes a directory")
    if source is not None and target.resolve() == source.resolve():
        raise UsageError(f"-o {str(target)!r} is the run's model.hf directory, which holds the model it was built "
                         "from: choose another -o")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in HF_OUTPUT_FILES)
    if foreign:
        raise UsageError(f"-o {str(target)!r} exists and holds {', '.join(foreign[:3])}, which an export does "
                         "not write: remove it or choose another -o")
    if any(target.iterdir()) and not (target / EXPORT_MARKER).is_file():
        raise UsageError(f"-o {str(target)!r} holds a model that is not an earlier hpcnet export: remove it or "
                         "choose another -o")



def write_hf(state: dict[str, Any], hf: str, options: dict[str, Any], target: Path,
             provenance: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """The model as a Hugging Face directory ``target`` (see the module's doc); returns its class name, and a
    line for each tokenizer file of the model directory that was left out, and why.

    Args:
        state: the model's full state dict.
        hf: the config.json or model directory to rebuild the model from (the run's ``model.hf``).
        options: the run's ``model.options``.
        target: the output directory; an earlier export there is replaced in place, anything else refused.
        provenance: what the export is of (checkpoint, step), written with ``model.hf`` to ``EXPORT_MARKER``.

    Raises:
        UsageError: the config cannot be built, the state does not fit it, the target is taken, or a tokenizer
            file cannot be read.
    """
    from hpcnet.models.hf import config_file, model_for_state

    try:
        model = model_for_state(hf, options, {k: tuple(v.shape) for k, v in state.items()},
                                option="--format hf (the run's model.hf)")
        config, directory = config_file(hf)
        _check_hf_target(target, directory or Path(config).parent)
    except ConfigError as exc:
        moved = "" if Path(hf).expanduser().exists() else "; --hf-config PATH names where the config is now"
        raise UsageError(f"{exc}{moved}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise UsageError(f"the checkpoint does not fit {hf!r}: {' '.join(str(exc).split())[:300]}") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one small bar a file on stderr, in a tool whose stderr is its errors
    made = file_kind(target) == "missing"
    if made:
        target.mkdir()
    stage = target / f"{STAGING_PREFIX}new-{secrets.token_hex(8)}"
    umask = os.umask(0)
    os.umask(umask)
    try:
        stage.mkdir()
        model.save_pretrained(str(stage))
        (stage / EXPORT_MARKER).write_text(json.dumps({"model.hf": hf, **(provenance or {})}) + "\n")
        for path in stage.iterdir():
            os.chmod(path, 0o666 & ~umask)  # transformers writes its weights 0600; others read what torch.save writes
        left_out = [note for name in (TOKENIZER_FILES if directory is not None else ())
                    if (note := _copy_regular(directory / name, stage / name, umask))]
        for path in stage.iterdir():
            fsync_path(path)
        _swap_in(stage, target)
    except BaseException:
        if made:
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return type(model).__name__, left_out


def _copy_regular(source: Path, copy: Path, umask: int) -> str | None:
    """Copy ``source`` if it is a regular file, never wider readable than it is; else say why it is left out (None:
    there is no such file).  A link is never followed: a model directory's ``tokenizer.json`` linked to a private
    file would otherwise put that file's content into a directory meant to be shared."""
    try:  # O_NONBLOCK: opening a FIFO does not wait for its writer
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"left out {str(source)!r}: a symbolic link (only the model directory's regular files are copied)"
        raise UsageError(f"cannot read {str(source)!r} of the model directory: {exc.strerror or exc}") from None
    with open(fd, "rb") as reading:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return f"left out {str(source)!r}: not a regular file"
        written = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(written, "wb") as writing:
            shutil.copyfileobj(reading, writing)
            os.fchmod(written, mode & 0o666 & ~umask)  # as cp: the source's permissions, narrowed by the umask
    return None


def _swap_in(stage: Path, target: Path) -> None:
    """Make ``target`` hold the files of ``stage`` (inside it) in place of an earlier export's: the directory stays
    the same one (a shell's working directory, ``-o .``, is not pulled from under it).  Each file is renamed, so a
    failure part way puts every file back as it was; nothing is deleted before every new file is in place."""
    old = target / f"{STAGING_PREFIX}old-{secrets.token_hex(8)}"
    old.mkdir()
    done: list[tuple[Path, Path]] = []
    try:
        # Only an export's files are there (_check_hf_target refused anything else).
        for path in sorted(p for p in target.iterdir() if p.name in HF_OUTPUT_FILES):
            os.rename(path, old / path.name)
            done.append((path, old / path.name))
        for path in sorted(stage.iterdir()):
            os.rename(path, target / path.name)
            done.append((path, target / path.name))
        fsync_path(target)
    except BaseException:
        for before, after in reversed(done):
            os.rename(after, before)
        old.rmdir()
        raise
    shutil.rmtree(old)
