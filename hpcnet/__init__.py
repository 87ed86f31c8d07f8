"""hpcnet: MPI-native data-parallel training for PyTorch on HPC clusters."""

from collections.abc import Callable

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
        import contextlib
        import ctypes
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG (Linux)
        _STANDBY_PARENT = os.getppid()


def _lazy_exports(package: str, exports: dict[str, str]
                  ) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """A subpackage's public surface, imported on first use: ``__all__`` and the module ``__getattr__`` and
    ``__dir__`` (PEP 562) for ``exports`` (public name -> the submodule that defines it).

    Lazy, so that importing one light module of a package (``hpcnet.launch.stop`` before torch, the torch-free
    supervisor, the report) does not import the rest of it.
    """
    import importlib

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return sorted(exports), __getattr__, __dir__


_hold_standby_release()
