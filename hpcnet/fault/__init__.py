"""Failure detection and injection: the flight recorder (``flightrec``), heartbeats and liveness, the monitor
thread, deadlines and the native watchdog, the memory watch, what a rank that detected a failure writes
(``failure``), and the ``fault.*`` injector (``inject``).  Reference: docs/fault-tolerance.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "Monitor": "monitor", "FaultInjector": "inject", "NULL_RECORDER": "flightrec", "NULL_DEADLINES": "watchdog",
    "io_timeout_s": "watchdog",
})
