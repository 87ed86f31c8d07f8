"""The bound of every duration option (every ``*_s`` field of a section), checked in one place."""

import dataclasses
import math
from typing import Any

from hpcnet.errors import ConfigError

MAX_DURATION_S = 30 * 24 * 3600
"""The longest any duration option (every ``*_s`` field) may be: 30 days.

A month is past any single wait a cluster job needs (job time limits are commonly a few days, the
longest rarely 30), so a larger value is a typo or a stand-in for 'never'; the options that mean
'never' say so with 0. The bound keeps every deadline built from a duration far inside what its
clock accepts: faulthandler and POSIX timers, ``time.sleep`` and sockets overflow past about 9.2e9 s
(292 years), ``datetime.timedelta`` (torch.distributed's timeouts) past 8.6e13 s, and the watchdog
adds a few multiples of these options to a deadline."""


def check_durations(section: Any, prefix: str) -> None:
    """Every ``*_s`` field of a config section is a finite number of seconds in [0, ``MAX_DURATION_S``].

    Sections call it after their own checks (which say more where 0 is not allowed), so every duration
    option, present and future, is bounded in one place.

    Args:
        section: a config dataclass.
        prefix: its name in dotted options, e.g. ``"monitor"``.
    """
    for f in dataclasses.fields(section):
        if not f.name.endswith("_s"):
            continue
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name} must be a finite number of seconds, got {value!r}")
        if value < 0:
            raise ConfigError(f"{prefix}.{f.name} must be >= 0 s, got {value:.10g}")
        if value > MAX_DURATION_S:
            raise ConfigError(f"{prefix}.{f.name} must be at most {MAX_DURATION_S} s (30 days), got {value:.10g}")
