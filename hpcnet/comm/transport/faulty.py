"""Fault injection in the data plane: a transport whose result fails on chosen ranks (``dist.fail_at_step``)."""

from typing import Any

import torch

from hpcnet.comm.transport.base import CommFailure, Handle, Transport


class FaultyTransport(Transport):
    """Fault injection: the wrapped transport's result fails on chosen ranks at one step.

    The collective itself still runs (so no rank is left inside it); the
    chosen ranks then report an error, as a NCCL error seen by one rank would.
    It offers what the wrapped transport offers.
    """

    def __init__(self, inner: Transport, *, fail: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.synchronous = inner.synchronous
        self.blocking_start = inner.blocking_start
        self.compresses = inner.compresses
        self.chunk_bytes = inner.chunk_bytes
        self.keeps_buckets = inner.keeps_buckets
        self.reduce_scatters = inner.reduce_scatters
        self.fail = fail
        self.armed = False

    def start(self, flat: torch.Tensor, key: Any = None) -> Handle:
        return self._maybe_failing(self.inner.start(flat, key))

    def start_reduce_scatter(self, flat: torch.Tensor, counts: list[int], out: torch.Tensor) -> Handle:
        return self._maybe_failing(self.inner.start_reduce_scatter(flat, counts, out))

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.allocate(numel, dtype)

    def _maybe_failing(self, handle: Handle) -> Handle:
        if self.armed and self.fail:
            return _FailingHandle(handle)
        return handle

    def close(self) -> None:
        self.inner.close()

    def abandon(self) -> None:
        self.inner.abandon()


class _FailingHandle:
    def __init__(self, inner: Handle) -> None:
        self.inner = inner

    def wait(self, timeout_s: float) -> None:
        self.inner.wait(timeout_s)
        raise CommFailure("injected communication failure (dist.fail_at_step)")
