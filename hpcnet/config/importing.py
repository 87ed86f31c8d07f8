"""Load user objects named by an import path such as ``package.module:function``; import what training needs."""

import importlib
from typing import Any

from hpcnet.errors import ConfigError


def is_import_path(text: str) -> bool:
    """Return True when ``text`` looks like ``package.module:attribute``."""
    module, sep, attr = text.partition(":")
    return bool(sep) and bool(module) and bool(attr) and "/" not in module


def load_object(path: str, option: str) -> Any:
    """Import ``package.module:attr.sub`` and return the object.

    Args:
        path: the import path.
        option: the dotted config option that named it, for error messages.
    """
    if not is_import_path(path):
        raise ConfigError(f"{option}: {path!r} is not an import path of the form 'package.module:function'")
    module_name, _, attr_path = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{option}: cannot import module {module_name!r} ({exc})") from exc
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ConfigError(f"{option}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ConfigError(f"{option}: {path!r} is not callable")
    return obj


def import_for_training() -> None:
    """What training will import anyway, imported now: at the top of ``run``, where every rank arrives at once
    (straight from agreeing on the config), and in a warm standby before it parks.

    torch.optim imports torch._dynamo on an optimizer's first add_param_group and on every ``step`` (seconds
    of CPU).  Imported in the middle of start-up, one rank imports while the others wait in a collective;
    on an oversubscribed host those waiters spin and yield, and the import can take long enough to exceed
    monitor.startup_timeout_s.  Imported here, every rank pays it at once, before the first
    collective; and ``--help``, ``--print-config`` and a bad option answer without it.
    """
    import torch._dynamo  # noqa: F401
