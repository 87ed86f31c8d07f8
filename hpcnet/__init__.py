"""hpcnet: MPI-native data-parallel training for PyTorch on HPC clusters."""

__version__ = "0.1.0"


_STANDBY_PARENT = 0
"""In a standby: its parent's pid when this package was first imported (``hpcnet.launch.park`` watches it)."""


def _hold_standby_release() -> None:
    """In a warm standby process of ``hpcnet.launch`` (``HPCNET_STANDBY`` set, nowhere else), before anything
    slow is imported: block its release signal (SIGUSR1's default action ends a process, and a release may come
    before the rank has parked in ``hpcnet.launch.park``, where it waits for it), and ask for SIGKILL when the
    launcher's process that started it dies, so a standby whose launcher was killed while it was still
    importing does not live on."""
    global _STANDBY_PARENT
    import os

    if os.environ.get("HPCNET_STANDBY"):
        import ctypes
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG (Linux)
        except (OSError, AttributeError):
            pass
        _STANDBY_PARENT = os.getppid()


_hold_standby_release()
