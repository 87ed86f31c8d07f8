"""Starting and restarting a job, torch-free.

``python -m hpcnet.launch [options] -- mpirun ... python -m hpcnet.train ...`` (``cli``, then ``supervisor``)
restarts an attempt after a restartable failure: ``attempt`` runs one, ``processes`` starts and reaps its
launcher, ``restarts`` decides (statuses, budget, backoff), ``exclusion`` which hosts to leave out and let back in
(``hosts``, ``elastic``), ``command`` reads and rewrites the launcher's command, ``standby`` and ``park`` keep a
warm standby attempt, ``forward`` passes stop signals on; ``stop`` is the rank's side of those signals.
Reference: docs/fault-tolerance.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "StopRequest": "stop", "hold_stop_signals": "stop", "describe_failure": "restarts",
    "describe_status": "restarts",
})
