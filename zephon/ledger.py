"""Batch ledgers: one digest per delivered batch, to prove two runs saw the same data (see :mod:`zephon.runtime.ledger`)."""

from .runtime.ledger import DiffResult as DiffResult
from .runtime.ledger import Ledger as Ledger
from .runtime.ledger import batch_digest as batch_digest
from .runtime.ledger import diff as diff
from .runtime.ledger import global_digests as global_digests
from .runtime.ledger import read_ledger as read_ledger
from .runtime.ledger import read_skips as read_skips
from .runtime.ledger import step_digest as step_digest

__all__ = ["Ledger", "batch_digest", "step_digest", "read_ledger", "read_skips", "global_digests", "diff", "DiffResult"]
