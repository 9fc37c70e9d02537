"""Operators, for composing transforms functionally outside a ``Pipeline``.

Each is a frozen configuration object with pure ``init(key)``, ``step(state, chunk)`` and
``flush(state)``; see ``docs/design/operators.md``.
"""

from ._batch import Batch as Batch
from ._core import EMPTY as EMPTY
from ._core import Chain as Chain
from ._core import FilterOp as FilterOp
from ._core import MapOp as MapOp
from ._core import Operator as Operator
from ._core import StatelessOp as StatelessOp
from ._core import config_field as config_field
from ._core import stateless as stateless
from ._fingerprint import FingerprintWarning as FingerprintWarning
from ._mixing import EnsureMixture as EnsureMixture
from ._pack import PackFlat as PackFlat
from ._pack import PackSequences as PackSequences
from ._pack import packing_info as packing_info
from ._shuffle import Shuffle as Shuffle

__all__ = [
    "EnsureMixture",
    "EMPTY",
    "Batch",
    "Chain",
    "FilterOp",
    "FingerprintWarning",
    "MapOp",
    "Operator",
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
]


def __getattr__(name: str):
    if name == "Tokenize":
        from ._tokenize import Tokenize

        return Tokenize
    if name in ("TokenizeChat", "TokenizePromptCompletion"):
        from . import _chat

        return getattr(_chat, name)
    raise AttributeError(f"module 'zephon.ops' has no attribute {name!r}")
