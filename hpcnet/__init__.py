"""hpcnet: MPI-native data-parallel training for PyTorch on HPC clusters."""

__version__ = "0.1.0"


def _hold_standby_release() -> None:
    """In a warm standby process of ``hpcnet.launch`` (``HPCNET_STANDBY`` set, nowhere else), block its release
    signal before anything slow is imported: SIGUSR1's default action ends a process, and a release may come
    before the rank has parked (``hpcnet.launch.park``), where it waits for it."""
    import os

    if os.environ.get("HPCNET_STANDBY"):
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


_hold_standby_release()
