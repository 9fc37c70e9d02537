"""Operators, for composing transforms functionally outside a ``Pipeline``.

Each is a frozen configuration object with pure ``init(key)``, ``step(state, chunk)`` and
``flush(state)``; see ``docs/design/operators.md``.
"""

from .batch import Batch as Batch
from ..core.operator import EMPTY as EMPTY
from ..core.operator import Chain as Chain
from ..core.operator import FilterOp as FilterOp
from ..core.operator import MapOp as MapOp
from ..core.operator import Operator as Operator
from ..core.operator import StatelessOp as StatelessOp
from ..core.operator import config_field as config_field
from ..core.operator import stateless as stateless
from ..core.fingerprint import FingerprintWarning as FingerprintWarning
from .lengths import LengthSchedule as LengthSchedule
from .mixing import EnsureMixture as EnsureMixture
from .order import OrderBy as OrderBy
from .order import token_count as token_count
from .pack import PackFlat as PackFlat
from .pack import PackSequences as PackSequences
from .pack import packing_info as packing_info
from .shuffle import Shuffle as Shuffle

__all__ = [
    "EnsureMixture",
    "EMPTY",
    "Batch",
    "Chain",
    "FilterOp",
    "FingerprintWarning",
    "LengthSchedule",
    "MapOp",
    "Operator",
    "OrderBy",
    "PackFlat",
    "PackSequences",
    "Shuffle",
    "StatelessOp",
    "Tokenize",
    "TokenizeChat",
    "TokenizePromptCompletion",
    "config_field",
    "packing_info",
    "stateless",
    "token_count",
]


def __getattr__(name: str):
    if name == "Tokenize":
        from .tokenize import Tokenize

        return Tokenize
    if name in ("TokenizeChat", "TokenizePromptCompletion"):
        from . import chat as _chat

        return getattr(_chat, name)
    raise AttributeError(f"module 'zephon.ops' has no attribute {name!r}")
