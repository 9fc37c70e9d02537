"""Pinning where the lanes of ``start_inline=True`` move to their workers, for tests.

Production hands a worker its lanes as soon as it is ready; tests that must know where each
output was computed replace that choice (on :class:`~zephon.runtime.process_executor.ProcessExecutor`) with a
count: worker ``w`` takes its lanes once exactly ``after[w]`` outputs were computed in the main
process (waiting for it to be ready then). The workers start at ``iter()`` and the lanes stay in
the main process until due, whatever the number of cores.
"""

from __future__ import annotations

from typing import Sequence

from zephon.runtime.process_executor import ProcessExecutor


def pin_hand_over(monkeypatch, after: Sequence[int]) -> None:
    """Hand worker ``w`` its lanes after ``after[w]`` outputs computed here (see the module docstring)."""
    init = ProcessExecutor.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.lead is not None:
            self.lead_while_starting = True  # never hand over early for want of cores
            if not self.procs:
                self._start_workers()

    def take_ready(self):
        due = {w for w in self.waiting if self.led >= after[w]}
        self._pump(lambda: due <= self.ready)
        for w in sorted(due):
            self._hand_over(w)

    monkeypatch.setattr(ProcessExecutor, "__init__", __init__)
    monkeypatch.setattr(ProcessExecutor, "_take_ready", take_ready)
