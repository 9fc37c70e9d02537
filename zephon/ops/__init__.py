"""Operators, for composing transforms functionally outside a ``Pipeline``.

Each is a frozen configuration object with pure ``init(key)``, ``step(state, chunk)`` and
``flush(state)``; see ``docs/design/operators.md``.
"""

from ..core.fingerprint import FingerprintWarning
from ..core.operator import EMPTY, Chain, FilterOp, MapOp, Operator, StatelessOp
from ..core.operator import config_field, stateless
from .batch import Batch
from .lengths import LengthSchedule
from .mixing import EnsureMixture
from .order import OrderBy, token_count
from .pack import PackFlat, PackSequences, packing_info
from .shuffle import Shuffle

__all__ = [
    "EnsureMixture", "EMPTY", "Batch", "Chain", "FilterOp", "FingerprintWarning", "LengthSchedule",
    "MapOp", "Operator", "OrderBy", "PackFlat", "PackSequences", "Shuffle", "StatelessOp",
    "Tokenize", "TokenizeChat", "TokenizePromptCompletion", "config_field", "packing_info",
    "stateless", "token_count",
]


def __getattr__(name: str):
    if name == "Tokenize":
        from .tokenize import Tokenize

        return Tokenize
    if name in ("TokenizeChat", "TokenizePromptCompletion"):
        from . import chat as _chat

        return getattr(_chat, name)
    raise AttributeError(f"module 'zephon.ops' has no attribute {name!r}")
