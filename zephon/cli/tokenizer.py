"""The ``--tokenizer`` and ``--special-tokens`` options of ``inspect`` and ``plan``.

Errors raised under them name the command's flags, not the Python arguments they stand for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..text.tokenizer import _LOCAL_ADVICE, TokenizerHandle, TokenizerLoadError, load_tokenizer

TOKENIZER_HELP = (
    "a tokenizer.json file, a folder holding one, or a Hugging Face id such as gpt2 (from the local hub cache, "
    "else downloaded; HF_HUB_OFFLINE=1 never downloads)"
)
SPECIAL_TOKENS_HELP = (
    "special tokens around each text (default: bos_eos when the tokenizer has a BOS token, else eos; "
    "bos when it has a BOS and no EOS, none when it has neither)"
)
SPECIAL_TOKEN_CHOICES = ("bos_eos", "bos", "eos", "none")

_CLI_ADVICE = (
    "pass a local file instead: --tokenizer path/to/tokenizer.json, or a folder holding tokenizer.json "
    "(and optionally tokenizer_config.json): --tokenizer path/to/folder"
)

#: Python argument -> the flag that sets it, for the messages of errors raised under the CLI.
FLAGS = {"tokenizer_id": "--tokenizer", **{name: "--" + name.replace("_", "-") for name in (
    "tokenizer", "special_tokens", "field", "chat_template", "loss_scope", "prompt_field", "completion_field"
)}}


def in_flags(message: str, flags: dict[str, str] | None = None) -> str:
    """``message`` with the Python arguments it names (keys of ``flags``, default :data:`FLAGS`)
    written as the CLI flags that set them.

    Examples:
        >>> in_flags("use special_tokens='eos', or set field= to the key")
        'use --special-tokens eos, or set --field to the key'
    """
    flags = FLAGS if flags is None else flags
    message = message.replace(_LOCAL_ADVICE, _CLI_ADVICE)
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    argument = re.compile(r"(?<![\w.\-])(" + names + r")=(?:'([^']*)'|\"([^\"]*)\")?")

    def flag(m: re.Match) -> str:
        value = m.group(2) if m.group(2) is not None else m.group(3)
        return flags[m.group(1)] + ("" if value is None else f" {value}")

    return argument.sub(flag, message)


def load(value: str, *, backend: str = "auto") -> TokenizerHandle:
    """The tokenizer ``--tokenizer VALUE`` names: a local file or folder, else a Hugging Face id.

    Raises:
        ValueError: it cannot be loaded; the message names ``--tokenizer``.
    """
    try:
        return load_tokenizer(tokenizer_id=value, backend=backend)
    except TokenizerLoadError as exc:
        raise ValueError(in_flags(str(exc))) from exc


def source_arguments(value: str) -> dict[str, Any]:
    """The keyword ``--tokenizer VALUE`` sets: ``tokenizer=`` a path, else ``tokenizer_id=``."""
    return {"tokenizer": value} if Path(value).expanduser().exists() else {"tokenizer_id": value}


def special_tokens(handle: TokenizerHandle, given: str | None) -> str:
    """The ``--special-tokens`` mode: ``given``, else the one that suits ``handle``.

    Raises:
        ValueError: the mode needs a BOS or EOS token the tokenizer does not have.
    """
    bos, eos = handle.bos_token_id is not None, handle.eos_token_id is not None
    # the modes this tokenizer can bracket with, the default first
    works = [m for m in SPECIAL_TOKEN_CHOICES if ("bos" not in m or bos) and ("eos" not in m or eos)]
    if given is None:
        return works[0]
    for role, present in (("BOS", bos), ("EOS", eos)):
        if role.lower() in given and not present:
            raise ValueError(
                f"--special-tokens {given} needs a {role} token, but the tokenizer ({handle.source}) has none; "
                f"use --special-tokens {' or '.join(works)} (without --special-tokens: {works[0]})"
            )
    return given
