"""Building a Config: defaults, then a TOML file (``--config run.toml``), then overrides of dotted keys
(``train.steps=200`` or ``--train.steps 200``); the train command line; the check that every rank has the
same config; TOML output and ``--help``.  The option tree itself is ``hpcnet.config``.
"""

import argparse
import ast
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcnet.config.options import Config
from hpcnet.errors import ConfigError

# --- building a Config from nested dicts ------------------------------------

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, option: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where lossless."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, option)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{option}: bad value {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = [parse_value(v.strip()) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{option}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{option}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{option}: expected a table of key = value, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{option}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{option}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # TOML reads nan and inf as floats; every comparison with nan is
            # false, so nan would slip through each field's own range check.
            if not math.isfinite(value):
                raise ConfigError(f"{option}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{option}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. run.name=2024 from the command line
        raise ConfigError(f"{option}: expected a string, got {value!r}")
    raise ConfigError(f"{option}: unsupported type {_type_name(tp)}")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        option = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(_unknown(option, cls, prefix))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{option}: is a section; set its keys, e.g. {option}.{_field_names(tp)[0]}=...")
            kwargs[key] = _build(tp, value, f"{option}.")
        else:
            kwargs[key] = _coerce(value, tp, option)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


RENAMED = {"dist.plan": "dist.owners", "dist.replan_every": "dist.reassign_every"}
"""Options that have a new name: old dotted name -> new.  An old name is an error that gives the new one, never
taken silently: a TOML file written for an older hpcnet says what to change."""


def _unknown(option: str, cls: type, prefix: str) -> str:
    if option in RENAMED:
        return f"option '{option}' was renamed '{RENAMED[option]}': set {RENAMED[option]} instead"
    known = [f"{prefix}{name}" for name in _field_names(cls)]
    close = difflib.get_close_matches(option, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f"; known here: {', '.join(known)}"
    return f"unknown option '{option}'{hint}"


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_value(text: str) -> Any:
    """Parse a command-line value as a TOML literal, else keep it as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"bad option name {key!r}")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"option {key!r} sets a key inside a value that is not a table")
    node[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["train.steps=5", "--optim.lr", "0.1", "--data.shuffle"]`` into a nested dict."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, text = key.split("=", 1)
            value = parse_value(text)
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--") and "=" not in args[i + 1]:
            value = parse_value(args[i + 1])
            i += 1
        elif arg.startswith("--"):
            value = True  # a bare flag, e.g. --data.shuffle
        else:
            raise ConfigError(f"cannot read argument {arg!r}: write options as section.key=value")
        _set_dotted(tree, key, value)
        i += 1
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the configuration from defaults, a TOML file and dotted overrides.

    Args:
        path: a TOML file with sections [run], [model], ...; None for defaults.
        overrides: command-line arguments such as ``train.steps=100``.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            tree = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config: file {str(path)!r} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config: cannot read {str(path)!r}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config: {str(path)!r} is not valid TOML: {exc}") from None
    tree = _merge(tree, parse_overrides(overrides or []))
    return _build(Config, tree, "")


@dataclass(slots=True)
class CommandLine:
    """``python -m hpcnet.train``'s command line: its own flags, and the dotted overrides."""

    config: str | None
    """--config: a TOML file."""
    resume: str | None
    """--resume: 'auto' or a checkpoint file (the same as checkpoint.resume, and it wins over it)."""
    print_config: bool
    help: bool
    help_config: bool
    """--help-config: print every option as Markdown (``docs/configuration.md``) and exit."""
    overrides: list[str]
    """Everything else: section.key=value (or --section.key value), for ``load_config``."""


def parse_command_line(argv: list[str]) -> CommandLine:
    """Read hpcnet.train's command line; ``hpcnet.launch`` reads the trainer's arguments with this too."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcnet.train", add_help=False,
        description="Data-parallel training over MPI. Options are section.key=value (or --section.key value).",
    )
    parser.add_argument("--config", help="a TOML file with [run], [model], [data], [optim], [train], [dist]")
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="resume from the newest checkpoint ('auto') or a checkpoint file (= checkpoint.resume)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("-h", "--help", action="store_true", help="show every option and exit")
    parser.add_argument("--help-config", action="store_true",
                        help="print every option as Markdown (docs/configuration.md) and exit")
    args, overrides = parser.parse_known_args(argv)
    return CommandLine(args.config, args.resume, args.print_config, args.help, args.help_config, overrides)


def command_line_config(args: CommandLine) -> Config:
    """The configuration of a command line: defaults, ``--config``, the overrides, then ``--resume`` (which wins
    over ``checkpoint.resume``); what ``hpcnet.train`` runs with and ``hpcnet.launch`` reads."""
    resume = [override("checkpoint.resume", args.resume)] if args.resume else []
    return load_config(args.config, args.overrides + resume)


def override(option: str, value: Any) -> str:
    """A command-line override that sets ``option`` to exactly ``value`` (a path such as ``1e3`` or ``true`` stays a
    string)."""
    return f"{option}={_toml_value(value)}"


def to_dict(cfg: Any) -> dict[str, Any]:
    """The configuration as plain nested dicts (JSON and TOML friendly)."""
    return dataclasses.asdict(cfg)


def config_hash(cfg: Config) -> str:
    """A digest of the resolved configuration, equal on ranks that hold equal configs."""
    text = json.dumps(to_dict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_config(comm: Any, cfg: Config) -> None:
    """Raise ConfigError on every rank unless all ranks of ``comm`` hold the same config."""
    digests = comm.allgather(config_hash(cfg))
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        majority = max(groups.values(), key=len)
        odd = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
        from hpcnet.agree import mark_agreed

        raise mark_agreed(ConfigError(
            f"ranks disagree on the configuration: ranks {odd} differ from ranks {majority[:8]}"
            f"{'...' if len(majority) > 8 else ''} (same command line and config file on every rank?)"
        ))


# --- TOML output and --help ----------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(cfg: Config) -> str:
    """The resolved configuration as TOML that ``--config`` reads back."""
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            try:
                lines.append(f"{key} = {_toml_value(value)}")
            except TypeError as exc:  # e.g. an object set in model.options from Python
                raise ConfigError(f"{section}.{key}: {exc}") from None
        lines.append("")
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of a dataclass, read from source, each joined into one line."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())  # one line, however it is wrapped
    return docs


def _markdown(doc: str) -> str:
    """A field docstring as one Markdown paragraph: lines joined, reST literals as code spans."""
    return " ".join(line.strip() for line in doc.strip().splitlines() if line.strip()).replace("``", "`")


def config_reference() -> str:
    """Every option as Markdown: section, name, type, default and docstring (``--help-config``).

    ``docs/configuration.md`` is this text; a test fails when the two differ, so the reference cannot go
    stale: a new or changed option changes its docstring here and the file is regenerated with
    ``python -m hpcnet.train --help-config > docs/configuration.md``.
    """
    hints = typing.get_type_hints(Config)
    section_docs = field_docs(Config)
    lines = ["# Configuration", "",
             "<!-- Generated by `python -m hpcnet.train --help-config > docs/configuration.md` from the field",
             "     docstrings of hpcnet/config/options.py (the fault section's: hpcnet/config/injection.py);",
             "     tests/test_docs.py fails when it is stale. -->",
             "",
             "Every option is `section.name`. A run takes the defaults below, then a TOML file (`--config FILE`,",
             "one `[section]` table each), then `section.name=value` (or `--section.name value`) arguments, later",
             "ones winning; `--print-config` prints the result and the run directory keeps it as `config.toml`.",
             "Every value is checked before anything starts, on every rank, and a bad one is an error naming the",
             "option (exit status 2).", ""]
    lines += [f"- [`[{section}]`](#{section}): {_markdown(section_docs.get(section, ''))}"
              for section in _field_names(Config)]
    for section in _field_names(Config):
        cls = hints[section]
        docs, types = field_docs(cls), typing.get_type_hints(cls)
        defaults = getattr(Config(), section)
        lines += ["", f"## {section}", "", _markdown(section_docs.get(section, "")), ""]
        for name in _field_names(cls):
            default = _toml_value(getattr(defaults, name))
            lines.append(f"- **`{section}.{name}`** (`{_type_name(types[name])}`, default `{default}`): "
                         f"{_markdown(docs.get(name, ''))}")
    return "\n".join(lines) + "\n"


def describe_options(cfg: Config | None = None) -> str:
    """Every option with its current value and docstring, for ``--help``."""
    cfg = cfg or Config()
    hints = typing.get_type_hints(Config)
    lines = []
    for section in _field_names(Config):
        cls = hints[section]
        docs = field_docs(cls)
        lines.append(f"[{section}]  {field_docs(Config).get(section, '')}")
        for name in _field_names(cls):
            value = getattr(getattr(cfg, section), name)
            lines.append(f"  {section}.{name} = {_toml_value(value)}")
            lines.append(f"      {docs.get(name, '')}")
    return "\n".join(lines)
