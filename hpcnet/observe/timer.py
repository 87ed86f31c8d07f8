"""Timing spans of the training step on CPU or GPU without adding synchronisation (``SpanTimer``): used by
``data.balance`` (each rank's forward and backward)."""

import time
from typing import Any

import torch


class SpanTimer:
    """Durations of spans of a step (a forward and backward, an optimizer update), without synchronising it.

    On CPU, wall-clock differences; on CUDA, events recorded in the stream and read only when ``drain`` is
    called (once per measuring window), so the step itself never waits for the GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []
        self._start: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._marks.append((self._start, end))
        self._start = None

    def discard(self) -> None:
        """Forget what was measured so far (a window that straddles a change of sizes)."""
        self._marks.clear()
        self._start = None

    def drain(self) -> list[float]:
        """Seconds of each timed span since the last call."""
        marks, self._marks = self._marks, []
        if self.cuda:
            if marks:
                marks[-1][1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in marks]
        return [end - start for start, end in marks]
