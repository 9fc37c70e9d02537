"""How many examples a costly law draws under the loaded hypothesis profile.

A law that starts processes or runs several whole pipelines per example keeps a small count under
the ``dev`` and ``ci`` profiles (the suite must stay within CI's minutes), and draws at least as
many as the profile asks for under the searching profiles (``nightly``, ``deep``: 500), so that a
deep run before an issue is resolved checks every law at least 500 times.
"""

from __future__ import annotations

from hypothesis import settings

#: The ``ci`` profile's example count: a profile asking for more is a searching one.
CI_EXAMPLES = 50


def examples(n: int) -> int:
    """``n`` under dev and ci; the profile's own count (at least ``n``) under a searching profile."""
    wanted = settings.default.max_examples
    return n if wanted <= CI_EXAMPLES else max(n, wanted)
