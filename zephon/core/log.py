"""Logging (the ``"zephon"`` logger, silent until configured) and tqdm progress bars.

Bars show when that logger is enabled for INFO; ``ZEPHON_PROGRESS=0`` or ``1`` forces them.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, TypeVar

T = TypeVar("T")

logger = logging.getLogger("zephon")
logger.addHandler(logging.NullHandler())

#: Seconds before a progress bar appears (shorter work never shows one).
PROGRESS_DELAY_S = 2.0

_warned_no_tqdm = False


def get_logger(name: str) -> logging.Logger:
    """The logger ``zephon.<name>``."""
    return logging.getLogger(f"zephon.{name}")


def enable_logging(level: int | str = "INFO", stream: Any = None) -> logging.Handler:
    """Print zephon's logs and progress bars to ``stream`` (default: stderr) at ``level``; returns
    the handler (one: calling it again replaces it).

    Examples:
        >>> import io, logging
        >>> buf = io.StringIO()
        >>> handler = enable_logging("INFO", stream=buf)
        >>> logging.getLogger("zephon.loader").info("hello")
        >>> buf.getvalue()
        'zephon.loader: hello\\n'
        >>> disable_logging()
    """
    disable_logging()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler._zephon = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def disable_logging() -> None:
    """Remove the handler :func:`enable_logging` added and restore the default level."""
    for h in list(logger.handlers):
        if getattr(h, "_zephon", False):
            logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)


def progress_enabled() -> bool:
    """Whether :func:`progress` draws a bar: ``ZEPHON_PROGRESS``, else the ``"zephon"`` logger at INFO."""
    forced = os.environ.get("ZEPHON_PROGRESS", "").strip().lower()
    if forced:
        return forced not in ("0", "false", "no", "off")
    return logger.isEnabledFor(logging.INFO)


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "", unit: str = "it", force: bool | None = None) -> Iterable[T]:
    """``iterable`` with a tqdm bar after :data:`PROGRESS_DELAY_S` seconds, leaving no line behind.

    ``force``: ``True``/``False`` always/never, ``None`` per :func:`progress_enabled`. Without
    tqdm, one log line says how to install it.
    """
    if not (progress_enabled() if force is None else force):
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        global _warned_no_tqdm
        if not _warned_no_tqdm:
            _warned_no_tqdm = True
            logger.info("progress bars need tqdm: pip install 'zephon-lanes[progress]'")
        return iterable
    return tqdm(iterable, total=total, desc=f"zephon: {desc}" if desc else "zephon", unit=unit, delay=PROGRESS_DELAY_S, leave=False)
