"""``python -m hpcnet.launch``: the supervisor (``hpcnet.launch.cli``, ``hpcnet.launch.supervisor``).

The stop signals are blocked first thing: one that comes while the supervisor imports and prepares waits for its
handlers (then no attempt is started), where the default action would kill it. They are ignored once ``main`` has
returned: the job's status is decided, and Python puts back the default action as it shuts down.
"""

import signal
import sys

from hpcnet.launch.stop import SUPERVISOR_SIGNALS

signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)

from hpcnet.launch.cli import main  # noqa: E402 - after the signals are held

status = main()
for _sig in SUPERVISOR_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
sys.exit(status)
