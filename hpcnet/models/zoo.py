"""The model zoo: the built-in models by name (``MODELS``), and building the one a run names.

``build_model(name, info, options)`` builds a model by name, a user factory or a Hugging Face model;
``build_from_config(cfg.model, info)`` is the one entry point for what a run's ``model.*`` options name, which the
trainer and the planner use.  Every built-in factory has the signature ``factory(info, **options)`` with
keyword-only options and defaults, so the options a config may set are exactly the factory's keyword parameters.
"""

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from hpcnet.config.importing import load_object
from hpcnet.config.options import ModelConfig
from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models.mlp import mlp
from hpcnet.models.resnet import BasicBlock, Bottleneck, resnet_factory
from hpcnet.models.transformer import transformer


def count_parameters(model: nn.Module) -> int:
    """Return the number of distinct parameter elements (tied weights count once).

    Args:
        model: any module; parameters may live on the meta device.
    """
    return sum(p.numel() for p in model.parameters())


MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet_factory("resnet18", BasicBlock, [2, 2, 2, 2]),
    "resnet34": resnet_factory("resnet34", BasicBlock, [3, 4, 6, 3]),
    "resnet50": resnet_factory("resnet50", Bottleneck, [3, 4, 6, 3]),
    "resnet101": resnet_factory("resnet101", Bottleneck, [3, 4, 23, 3]),
    "resnet152": resnet_factory("resnet152", Bottleneck, [3, 8, 36, 3]),
    "resnet_tiny": resnet_factory("resnet_tiny", BasicBlock, [1, 1, 1, 1], default_width=16),
    "mlp": mlp,
    "transformer": transformer,
}
"""Built-in models: name -> ``factory(info, **options)``."""


def _check_options(factory: Callable[..., Any], info: DatasetInfo, options: dict[str, Any], label: str) -> None:
    # Checking against the signature before calling keeps a TypeError raised inside
    # model construction (a bug) from being reported as a bad option.
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # some builtins have no signature; let the call itself fail
    try:
        signature.bind(info, **options)
    except TypeError as exc:
        params = signature.parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        valid = [n for n, p in list(params.items())[1:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        unknown = [] if accepts_any else [k for k in options if k not in valid]
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                     for k in unknown]
            raise ConfigError(
                f"model.options: unknown option {', '.join(hints)} for model {label}; "
                f"valid options: {', '.join(valid) or '(none)'}"
            ) from None
        option = "model.factory" if label.startswith("factory") else "model.options"
        raise ConfigError(f"{option}: cannot call {label} as fn(info, **options): {exc}") from None


def build_model(
    name: str, info: DatasetInfo, options: dict[str, Any] | None = None, *, factory: str = "", hf: str = ""
) -> nn.Module:
    """Build a model for the dataset described by ``info``.

    Args:
        name: a key of ``MODELS``; ignored when ``factory`` is given.
        info: the dataset the model will be trained on.
        options: keyword options for the factory (``model.options``).
        factory: import path ``package.module:function`` of a user factory called as
            ``function(info, **options)``; empty to use the built-in ``name``.
        hf: ``model.hf``: a local Hugging Face config.json or model directory (``hpcnet.models.hf``);
            ``options`` then override the config's fields.  Overrides ``name``; excludes ``factory``.

    Raises:
        ConfigError: unknown name, unknown or bad option, a factory that cannot be
            loaded or does not return a module, or a model that does not fit the data.
    """
    options = dict(options or {})
    if hf:
        if factory:
            raise ConfigError("model.hf and model.factory both name the model: set one of them")
        from hpcnet.models.hf import build_hf_model  # imports transformers: only when asked for

        return build_hf_model(hf, info, options)
    if factory:
        make = load_object(factory, "model.factory")
        label = f"factory {factory!r}"
    else:
        if name not in MODELS:
            close = difflib.get_close_matches(name, MODELS, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"model.name: unknown model {name!r}{hint}; choose one of {', '.join(sorted(MODELS))}"
            )
        make = MODELS[name]
        label = repr(name)
    _check_options(make, info, options, label)
    model = make(info, **options)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: {factory or name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_from_config(model: ModelConfig, info: DatasetInfo) -> nn.Module:
    """Build the model a run's ``model.*`` options name (``model.hf``, ``model.factory`` or ``model.name``, with
    ``model.options``) for the dataset ``info``: what training trains and ``python -m hpcnet.plan`` measures.

    Raises:
        ConfigError: as ``build_model``.
    """
    return build_model(model.name, info, model.options, factory=model.factory, hf=model.hf)
