"""Where tests find the material shared next to the repository: ``<repo>/../shared``.

That folder (the GPT-2 tokenizer, a text corpus) is not part of the product. Tests that need it
skip when it is missing, except in CI (``CI=true``), where a missing file is a failure, so that a
broken checkout cannot pass by skipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: ``<repo>/../shared``, found from this file (never from an absolute path).
SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(*parts: str) -> Path:
    """``SHARED / parts``; when it does not exist, fail under ``CI=true`` and skip otherwise.

    Usable in a test, a fixture or at module level.
    """
    path = SHARED.joinpath(*parts)
    if not path.exists():
        message = f"{path} is missing (the shared folder next to the repository)"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"{message}; CI=true requires it", pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return path
