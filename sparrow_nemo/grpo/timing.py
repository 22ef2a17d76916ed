"""Wall-clock time of each phase of an RL step, as ``timing/<phase>`` metrics (seconds, NeMo-RL's names).

On a GPU the phase's queued kernels are waited for (``torch.cuda.synchronize``) before its clock stops, so
an asynchronous launch is charged to the phase that launched it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per phase name; ``metrics()`` returns ``{"timing/<name>": seconds}``.

    The same name used twice in a step adds up (e.g. two engine wake-ups).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        """Seconds since the timer was made."""
        return time.perf_counter() - self._start

    def metrics(self) -> dict[str, float]:
        """``timing/<phase>`` for every phase timed so far."""
        return {f"timing/{name}": value for name, value in self.seconds.items()}
