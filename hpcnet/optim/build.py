"""The optimizer (``optim.name``, ``optim.options``, ``optim.factory``): built over the model's parameters in two
weight-decay groups, and rebuilt like itself over the units a rank owns (``dist.zero``: ``rebuild_optimizer``).

Every bad input is a ConfigError naming the option: an unknown name (``OptimConfig``), an option the constructor
does not take (``optim.options.<key>``, with what it takes), a value torch refuses (the option that makes it
refuse), a factory that cannot be imported, raises or returns something else than an optimizer
(``optim.factory``).
"""

import inspect
from typing import Any

import torch
from torch import nn

from hpcnet.config import OptimConfig
from hpcnet.config.importing import load_object
from hpcnet.config.optimizers import ELEMENTWISE_CLASSES, OPTIMIZERS
from hpcnet.errors import ConfigError
from hpcnet.optim.muon import ADAMW, MUON, MuonWithAdamW, hidden_weights

FACTORY = "optim.factory"


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names over ``model``'s trainable parameters; no weight decay on biases and norm
    weights (1-d tensors) unless a factory regroups; ``fused``: torch's single-kernel implementation
    (``cuda.fused_optimizer``) where the optimizer has one.

    Raises:
        ConfigError: naming the ``optim.*`` option torch or the factory refuses.
    """
    groups = decay_groups(model, cfg.weight_decay)
    if cfg.factory:
        return _from_factory(groups, cfg)
    if cfg.name == MUON:
        hidden = hidden_weights(model)
        muon = {"update": MUON, "weight_decay": cfg.weight_decay, "adjust_lr_fn": "match_rms_adamw", **options(cfg)}
        adamw = {"update": ADAMW, "betas": tuple(cfg.betas), "eps": cfg.eps}
        groups = [{**muon, "lr": cfg.lr, "params": [p for p in groups[0]["params"] if id(p) in hidden]},
                  *({**adamw, **g, "lr": cfg.lr, "params": [p for p in g["params"] if id(p) not in hidden]}
                    for g in groups)]
        _check_options(torch.optim.Muon, cfg, fused=False)
        return _construct(MuonWithAdamW, [groups], {}, cfg, _device(model))
    cls = getattr(torch.optim, OPTIMIZERS[cfg.name].cls)
    keywords = _check_options(cls, cfg, fused)
    if "weight_decay" not in keywords:
        for g in groups:
            del g["weight_decay"]
    return _construct(cls, [groups], {k: v for k, v in keywords.items() if k != "weight_decay"}, cfg, _device(model))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two groups: 2-D and larger with ``weight_decay``, the rest (biases, norm
    weights) without."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def options(cfg: OptimConfig) -> dict[str, Any]:
    """``optim.options`` as the constructor takes them: a list (TOML has no tuples) as a tuple."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.options.items()}


def _check_options(cls: type, cfg: OptimConfig, fused: bool) -> dict[str, Any]:
    """The keywords for ``cls``: lr, weight_decay where it takes one, the ``optim.*`` options its registry entry
    takes, ``optim.options`` and ``fused``; ConfigError naming an ``optim.options`` key it does not take."""
    accepted = [k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "params")]
    takes = OPTIMIZERS[cfg.name].takes
    own = {"lr", "weight_decay", *(() if cfg.name == MUON else takes)}
    for key in cfg.options:
        if key in own:
            raise ConfigError(f"optim.options.{key}: set optim.{key} instead")
        if key == "fused":
            raise ConfigError("optim.options.fused: set cuda.fused_optimizer instead")
        if key not in accepted:
            raise ConfigError(f"optim.options.{key}: {cfg.name} ({cls.__name__}) takes no option {key!r}; it takes "
                              f"{', '.join(k for k in accepted if k not in own and k != 'fused')}")
    keywords: dict[str, Any] = {"lr": cfg.lr}
    if "weight_decay" in accepted:
        keywords["weight_decay"] = cfg.weight_decay
    values = {"momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0, "betas": tuple(cfg.betas),
              "eps": cfg.eps}
    keywords.update({k: values[k] for k in takes if cfg.name != MUON})
    keywords.update(options(cfg))
    if fused and "fused" in accepted:
        keywords["fused"] = True
    return keywords


def _device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _construct(cls: type, args: list[Any], keywords: dict[str, Any], cfg: OptimConfig,
               device: torch.device) -> torch.optim.Optimizer:
    """``cls(*args, **keywords)`` once each of ``optim.options`` passed ``_probe`` on ``device``; ConfigError where
    torch refuses."""
    probed = torch.optim.Muon if cls is MuonWithAdamW else cls
    for key, value in cfg.options.items():
        _probe(probed, key, value, cfg.name, device)
    try:
        return cls(*args, **keywords)
    except (ValueError, TypeError, RuntimeError) as exc:
        fused_note = " with cuda.fused_optimizer" if keywords.get("fused") else ""
        raise ConfigError(f"optim.* ({cfg.name}{fused_note}): torch refuses the optimizer: {exc}") from exc


def _probe(cls: type, key: str, value: Any, name: str, device: torch.device) -> None:
    """ConfigError naming ``optim.options.<key>`` unless ``value`` has the type of the constructor's default and
    ``cls`` takes it alone and steps with it, on a 2x2 parameter on the model's ``device`` (capturable needs the
    GPU): torch checks some values only in ``step``."""
    default = inspect.signature(cls.__init__).parameters[key].default
    expected = {bool: (bool,), int: (int,), float: (int, float)}.get(type(default))
    if expected and (not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected)):
        raise ConfigError(f"optim.options.{key}: {name} takes a {type(default).__name__} "
                          f"(default {default!r}), got {value!r}")
    probe = nn.Parameter(torch.ones(2, 2, device=device))
    probe.grad = torch.ones(2, 2, device=device)
    try:
        cls([probe], **{key: tuple(value) if isinstance(value, list) else value}).step()
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"optim.options.{key}: {name} refuses {value!r}: {exc}") from exc


def _from_factory(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """``fn(groups, cfg)`` of ``optim.factory``; ConfigError naming it when it raises or returns no optimizer."""
    fn = load_object(cfg.factory, FACTORY)
    try:
        optimizer = fn(groups, cfg)
    except Exception as exc:
        raise ConfigError(f"{FACTORY}: {cfg.factory} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{FACTORY}: {cfg.factory} returned a {type(optimizer).__name__}, not a "
                          f"torch.optim.Optimizer")
    return optimizer


def is_elementwise(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> bool:
    """Whether ``optimizer``'s update is elementwise (``hpcnet.config.optimizers``): what its class declares or
    the registry knows of it (torch's by name, known library classes), else what ``optim.elementwise`` says."""
    known = class_is_elementwise(type(optimizer))
    return cfg.elementwise if known is None else known


def class_is_elementwise(cls: type) -> bool | None:
    """What ``cls`` declares (a class attribute ``elementwise = True`` or ``False``), what the registry knows of
    torch's and library classes, or None: unknown."""
    declared = getattr(cls, "elementwise", None)
    if isinstance(declared, bool):
        return declared
    if getattr(torch.optim, cls.__name__, None) is cls:
        return {known.cls: known.elementwise for known in OPTIMIZERS.values()}.get(cls.__name__)
    return True if f"{cls.__module__}.{cls.__qualname__}" in ELEMENTWISE_CLASSES else None


def rebuild_optimizer(full: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``full``'s class over ``groups`` (param groups with ``full``'s hyperparameters): the
    constructor's keywords from ``full.defaults``, as torch's ZeroRedundancyOptimizer rebuilds one.
    ``MuonWithAdamW``'s groups carry everything it takes.

    Raises:
        ConfigError: naming ``optim.factory`` when the class cannot be built so (a keyword it needs that is not
            in its defaults).
    """
    cls = type(full)
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in full.defaults.items() if k in accepted and k != "params"}
    try:
        return cls(groups, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{FACTORY}: {cls.__name__} cannot be rebuilt over the parameters a rank owns "
                          f"(dist.zero) from its defaults: {exc}") from exc


def describe(optimizer: torch.optim.Optimizer, elementwise: bool) -> str:
    """One line for the log: the optimizer's class, what each kind of param group updates (Muon's split), and
    whether owners may hold rows of a parameter (``dist.zero`` 1 to 3) or only whole ones."""
    kinds: dict[str, list[int]] = {}
    for group in optimizer.param_groups:
        counts = kinds.setdefault(f"{group['update']} " if "update" in group else "", [0, 0])
        counts[0] += len(group["params"])
        counts[1] += sum(p.numel() for p in group["params"])
    parts = ", ".join(f"{kind}over {tensors} tensor(s) ({numel:,} parameters)"
                      for kind, (tensors, numel) in kinds.items())
    cut = "elementwise: a large parameter may be owned in row ranges" if elementwise else (
        "not elementwise: every parameter is owned whole")
    return f"optimizer {type(optimizer).__name__}: {parts}; {cut}"
