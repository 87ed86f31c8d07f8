"""Hugging Face transformers models (``model.hf``): built from a local config.json or model directory.

``build_hf_model(path, info, options)`` is what ``build_model`` calls for ``model.hf = PATH``:

- PATH a ``config.json`` file: the architecture only, freshly initialised (``from_config``; hpcnet seeds first).
- PATH a directory with ``config.json``: with weights there (``model.safetensors``, a sharded index or
  ``pytorch_model.bin``) ``from_pretrained``, else ``from_config``.
- The dataset's kind picks the head: ``tokens`` -> ``AutoModelForCausalLM``; ``sequence`` (one label a
  sample) -> ``AutoModelForSequenceClassification`` with ``num_labels = info.num_classes``; any other kind is
  a ConfigError.
- ``model.options`` override fields of config.json (``model.options.n_layer=4``), as if the file said so; two
  are not config fields: ``attn_implementation`` (default ``sdpa``) and ``dtype`` (default ``float32``).

Always local (``local_files_only``, ``HF_HUB_OFFLINE``): nothing is downloaded.  Never a model directory's own
code (``trust_remote_code=False`` on every call): a config.json whose ``auto_map`` names code for a model type
transformers does not know is a ConfigError, and transformers never asks on a terminal whether to run it.
Fields whose names say they size or count something cannot be negative, and no parameter may come out empty
(``check_sizes``, ``check_not_empty``).  The parameters are float32
whatever config.json's ``dtype``/``torch_dtype`` says (that records how the weights were stored; hpcnet keeps
float32 weights and ``train.precision=bf16`` autocasts over them); ``model.options.dtype`` asks otherwise.
Attention is ``sdpa``: transformers' own default, so the exported model loaded with plain ``from_pretrained``
computes the same bits as the trained one, and on a CPU its kernels are deterministic.  The KV cache is off
(``use_cache=False``) in training: a training forward has no use for it.  Reference: docs/models.md.
"""

import functools
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from hpcnet.errors import ConfigError

log = logging.getLogger("hpcnet.models")

CONFIG_NAME = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""Files whose presence in a model directory means it carries weights (transformers' names)."""
ATTN_IMPLEMENTATION = "sdpa"
DTYPES = ("float32", "bfloat16", "float16")
BUILD_OPTIONS = ("attn_implementation", "dtype")
"""``model.options`` that are not config.json fields but arguments of the build."""
SIZE_FIRST_WORDS = ("n", "num", "d", "max")
SIZE_LAST_WORDS = ("size", "dim", "dims", "layers", "heads", "embd", "positions", "embeddings", "experts", "channels",
                   "labels")
"""A config field sizes or counts something when its name's first word (``n_layer``, ``num_hidden_layers``,
``d_model``, ``max_position_embeddings``) or last word (``hidden_size``, ``head_dim``, ``encoder_layers``) says so:
transformers' naming, whatever the model type.  Ids and indices (``pad_token_id``, ``vision_feature_layer``),
which may be negative, are neither; nor is a field whose config class defaults to a negative value (a sentinel:
DeBERTa's ``max_relative_positions=-1``)."""
HEADS = {"tokens": "AutoModelForCausalLM", "sequence": "AutoModelForSequenceClassification"}
"""Dataset kind -> the transformers Auto class whose model trains on it."""
INSTALL = "pip install 'hpcnet[hf]'"


def import_transformers(option: str = "model.hf") -> Any:
    """The transformers module, offline; ConfigError naming ``option`` and the extra when it is missing."""
    # hpcnet never reads from the hub; offline, huggingface_hub does not probe the network either (a compute
    # node without one would wait out the probe's timeout).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"{option} needs the transformers package: {INSTALL} ({exc})") from None
    return transformers


def config_file(path: str, option: str = "model.hf") -> tuple[Path, Path | None]:
    """``(config.json, the model directory if PATH is one)``; ConfigError naming ``option`` when PATH is
    neither a config file nor a directory holding one."""
    where = Path(path).expanduser()
    if where.is_dir():
        if not (where / CONFIG_NAME).is_file():
            raise ConfigError(f"{option}: directory {path!r} has no {CONFIG_NAME} (a Hugging Face model directory "
                              f"or a config.json file is needed)")
        return where / CONFIG_NAME, where
    if where.is_file():
        return where, None
    raise ConfigError(f"{option}: {path!r} does not exist (a local config.json or model directory; hpcnet does "
                      "not download from the Hugging Face hub)")


def load_config(path: str, options: dict[str, Any] | None = None, *, training: bool = True,
                option: str = "model.hf") -> tuple[Any, dict[str, Any], Path | None]:
    """The model's transformers config with ``options`` applied, the build's keyword arguments, and the model
    directory (None for a bare config.json).

    Args:
        path: ``model.hf``.
        options: ``model.options``: config fields to override, and the build options ``BUILD_OPTIONS``.
        training: switch the KV cache off (unless ``options`` set ``use_cache``).
        option: the option named in errors.

    Raises:
        ConfigError: transformers missing, no such path, not a config, a model type transformers does not know,
            an option that is no field of the config, a bad dtype or attention implementation.
    """
    transformers = import_transformers(option)
    import torch

    file, directory = config_file(path, option)
    _refuse_own_code(transformers, file, option)
    options = dict(options or {})
    build = {"attn_implementation": options.pop("attn_implementation", ATTN_IMPLEMENTATION)}
    dtype = options.pop("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"model.options.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    # transformers 4.56 renamed torch_dtype to dtype; the extra allows 4.46 on.
    major = int(transformers.__version__.split(".")[0])
    build["dtype" if major >= 5 else "torch_dtype"] = getattr(torch, dtype)
    try:
        config = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True, trust_remote_code=False)
        if options:
            unknown = [k for k in options if not hasattr(config, k)]
            if unknown:
                import difflib

                fields = sorted(config.to_dict())
                hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, fields, 1))
                         else repr(k) for k in unknown]
                raise ConfigError(f"model.options: {', '.join(hints)} is no field of the {config.model_type} config "
                                  f"{str(file)!r} (with model.hf, model.options override config.json's fields, "
                                  f"or set {' or '.join(BUILD_OPTIONS)})")
            # Rebuilt from the file's own fields plus the overrides, so that what __init__ derives from them
            # (a head_dim from hidden_size) follows the overrides too.
            raw = json.loads(file.read_text())
            config = type(config).from_dict({**raw, **options})
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' and huggingface_hub's validation errors have no common base
        raise ConfigError(f"{option}: {str(file)!r}{f' with model.options {options}' if options else ''} is not a "
                          f"config transformers {transformers.__version__} can build: {_first_line(exc)}") from None
    check_sizes(config, options, file)
    if training and "use_cache" not in options and hasattr(config, "use_cache"):
        config.use_cache = False
    return config, build, directory


def _refuse_own_code(transformers: Any, file: Path, option: str) -> None:
    """ConfigError when ``file`` names code of its own (``auto_map``) for a model type transformers does not know:
    the only way to build it would be to run that code."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # transformers' own reading says what is wrong with it
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and raw.get("auto_map") and model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"{option}: {str(file)!r} names code of its own (auto_map) for model type {model_type!r}, "
                          f"which transformers {transformers.__version__} does not know; hpcnet never runs a model "
                          "directory's code (trust_remote_code=False): use a model type transformers has")


def is_size_field(name: str) -> bool:
    """True when the config field ``name`` sizes or counts something (``SIZE_FIRST_WORDS``, ``SIZE_LAST_WORDS``)."""
    words = name.split("_")
    return len(words) > 1 and (words[0] in SIZE_FIRST_WORDS or words[-1] in SIZE_LAST_WORDS)


def _size_fields(config: Any) -> dict[str, tuple[int, Any]]:
    """The integer fields of ``config`` that size or count something, nested configs' as ``text_config.name``:
    ``(value, the config class's default)`` (``inspect.Parameter.empty`` where it has none)."""
    found = {}

    def walk(cfg: Any, prefix: str) -> None:
        defaults = _class_defaults(type(cfg))
        for name, value in cfg.to_dict().items():
            nested = getattr(cfg, name, None) if isinstance(value, dict) else None
            if hasattr(nested, "to_dict") and hasattr(nested, "model_type"):  # a config within the config
                walk(nested, f"{prefix}{name}.")
            elif isinstance(value, int) and not isinstance(value, bool) and is_size_field(str(name)):
                found[prefix + name] = (value, defaults.get(name, inspect.Parameter.empty))

    walk(config, "")
    return found


@functools.cache
def _class_defaults(cls: type) -> dict[str, Any]:
    """The defaults of a config class's ``__init__``: what the class itself holds in a field's domain."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _where(name: str, options: dict[str, Any], file: Path) -> str:
    """Where a config field's value came from: ``model.options.NAME=VALUE`` or config.json's ``NAME=VALUE``."""
    return f"model.options.{name}" if name in options else f"model.hf: {str(file)!r} sets {name}"


def check_sizes(config: Any, options: dict[str, Any], file: Path) -> None:
    """ConfigError naming the option (or config.json's field) for a size or count that is negative: transformers
    takes ``range(-1)`` as no layers and a negative width as a tensor it cannot make, sometimes only in the
    forward.  Where the config class's own default is negative (DeBERTa's ``max_relative_positions=-1``: no
    limit), negative values are in the field's domain."""
    for name, (value, default) in _size_fields(config).items():
        if value < 0 and not (isinstance(default, int) and default < 0):
            raise ConfigError(f"{_where(name, options, file)}={value}: {name.rpartition('.')[2]} is a size or count of "
                              f"the {config.model_type} config (its name says so), which cannot be negative")


def check_not_empty(model: nn.Module, options: dict[str, Any], file: Path) -> None:
    """ConfigError when a parameter of ``model`` has no elements: a size of 0 (``n_inner=0``) that builds a model
    whose forward fails or computes nothing; named by the fields that are 0."""
    empty = next(((name, tuple(p.shape)) for name, p in model.named_parameters() if p.numel() == 0), None)
    if empty is None:
        return
    zeros = [name for name, (value, _) in _size_fields(model.config).items() if value == 0]
    culprit = f"{_where(zeros[0], options, file)}=0" if zeros else f"model.hf: {str(file)!r}"
    raise ConfigError(f"{culprit} leaves the model's parameter {empty[0]} with no elements (shape {empty[1]}): "
                      "sizes must be at least 1")


def _first_line(exc: BaseException) -> str:
    """The message's first line, and the next too where the first ends with a colon (a validation error's field,
    then what is wrong with it)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _has_weights(directory: Path | None) -> bool:
    return directory is not None and any((directory / name).is_file() for name in WEIGHT_FILES)


def auto_class(kind: str, path: str, option: str = "model.hf") -> Any:
    """The transformers Auto class for a dataset of ``kind``; ConfigError naming ``option`` for other kinds."""
    if kind not in HEADS:
        raise ConfigError(f"{option}: no Hugging Face model head for {kind!r} data ({path!r}): "
                          f"{', '.join(f'{k!r} data trains {v}' for k, v in HEADS.items())}")
    return getattr(import_transformers(option), HEADS[kind])


def _check_fits(config: Any, info: Any, path: str) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if info.kind == "tokens":
        vocab = getattr(text, "vocab_size", None)
        if vocab is not None and vocab < info.num_classes:
            raise ConfigError(f"model.hf: the vocabulary of {path!r} has {vocab} tokens, fewer than the dataset's "
                              f"{info.num_classes}: set model.options.vocab_size={info.num_classes} (or more)")
    positions = getattr(text, "max_position_embeddings", None)
    if isinstance(positions, int) and info.input_shape and info.input_shape[0] > positions:
        raise ConfigError(f"model.hf: the dataset's sequences have {info.input_shape[0]} tokens, more than the "
                          f"{positions} positions of {path!r} (max_position_embeddings; n_positions for GPT-2): "
                          "override it in model.options")
    if info.kind == "sequence" and getattr(config, "pad_token_id", None) is None:
        raise ConfigError(f"model.hf: {path!r} sets no pad_token_id, which a sequence classifier needs to find "
                          "each sample's last token: set model.options.pad_token_id to the token your data pads "
                          "with (one that never occurs inside a sequence)")


def build_hf_model(path: str, info: Any, options: dict[str, Any] | None = None) -> nn.Module:
    """Build the transformers model ``model.hf`` names for the dataset ``info`` (see the module's doc).

    Args:
        path: a local config.json, or a model directory (config.json, weights optional).
        info: the dataset (``DatasetInfo``): its kind picks the head, its num_classes is checked against the
            vocabulary (tokens) or is the number of labels (sequence).
        options: ``model.options``: config.json fields to override, ``attn_implementation``, ``dtype``.

    Raises:
        ConfigError: naming model.hf (or model.options) for every input that does not build a model that fits.
    """
    config, build, directory = load_config(path, options)
    auto = auto_class(info.kind, path)
    if info.kind == "sequence":
        config.num_labels = info.num_classes
    _check_fits(config, info, path)
    if _has_weights(directory):
        try:
            model, loading = auto.from_pretrained(str(directory), config=config, local_files_only=True,
                                                  output_loading_info=True, trust_remote_code=False, **build)
        except Exception as exc:  # noqa: BLE001 - a corrupt file is a SafetensorError, a wrong shape a RuntimeError
            raise ConfigError(f"model.hf: cannot load the weights in {path!r}: {_first_line(exc)}") from None
        fresh = loading.get("missing_keys") or []
        ignored = loading.get("unexpected_keys") or []
        log.info("model.hf: weights from %s%s%s", path,
                 f"; {len(fresh)} tensor(s) initialised afresh ({', '.join(sorted(fresh)[:4])} ...)" if fresh else "",
                 f"; {len(ignored)} stored tensor(s) unused" if ignored else "")
    else:
        try:
            model = auto.from_config(config, trust_remote_code=False, **build)
        except Exception as exc:  # noqa: BLE001 - an attn_implementation this model lacks, a head count of 0
            raise ConfigError(f"model.hf: cannot build {path!r} as {auto.__name__} (with model.options "
                              f"{options or {}}): {_first_line(exc)}") from None
    check_not_empty(model, options or {}, config_file(path)[0])
    # from_pretrained hands the model over in eval mode; hpcnet's loop expects a module as torch builds it.
    return model.train()


def model_for_state(path: str, options: dict[str, Any] | None, keys_shapes: dict[str, tuple[int, ...]],
                    option: str = "model.hf") -> nn.Module:
    """The transformers model whose state dict has exactly ``keys_shapes`` (a trained run's), built afresh from
    ``path`` and ``options`` as the run built it: a causal LM, or a sequence classifier with as many labels as
    its head has rows.  For export, where the run's dataset is not at hand to say which.

    Raises:
        ConfigError: as ``load_config``; or neither head has the state's keys (named, a few).
    """
    import torch

    config, build, _ = load_config(path, options, training=False, option=option)
    tried = []
    for kind, name in HEADS.items():
        auto = auto_class(kind, path, option)
        with torch.device("meta"):  # only the names and shapes: no memory, no initialisation
            probe = auto.from_config(config, trust_remote_code=False, **build).state_dict()
        shapes = {k: tuple(v.shape) for k, v in probe.items()}
        if set(shapes) != set(keys_shapes):
            tried.append((name, sorted(set(shapes) - set(keys_shapes)), sorted(set(keys_shapes) - set(shapes))))
            continue
        if kind == "sequence":  # the head's rows: the labels the run's dataset had
            rows = {keys_shapes[k][0] for k, s in shapes.items()
                    if s != keys_shapes[k] and s[:1] == (config.num_labels,) and s[1:] == keys_shapes[k][1:]}
            if len(rows) == 1:
                config.num_labels = rows.pop()
        return auto.from_config(config, trust_remote_code=False, **build)
    detail = "; ".join(f"{name}: missing {', '.join(missing[:3]) or 'none'}, unexpected "
                       f"{', '.join(unexpected[:3]) or 'none'}" for name, missing, unexpected in tried)
    raise ConfigError(f"{option}: the checkpoint's model is not the one {path!r} builds ({detail})")
