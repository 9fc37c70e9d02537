"""Batch ledgers: one digest per delivered batch, to prove two runs saw the same data (see :mod:`zephon.runtime.ledger`)."""

from .runtime.ledger import DiffResult, Ledger, batch_digest, diff, global_digests
from .runtime.ledger import read_ledger, read_skips, step_digest

__all__ = ["Ledger", "batch_digest", "step_digest", "read_ledger", "read_skips", "global_digests", "diff", "DiffResult"]
