"""``zephon inspect PATH``: the first records of a dataset, tokenized and decoded, with their masks.

Meant for the minute before a training run: is the field name right, does the chat template
render what the model should see, which tokens carry loss? Reads the first ``--n`` rows of the
file or folder (in file order), applies the same operator the pipeline would (``tokenize``,
``tokenize_chat`` or prompt/completion tokenization) to each row on its own, and prints the
decoded text with the supervised spans marked, the first tokens with their ids and masks, and
any error for that row (a missing field, an empty mask) instead of stopping at the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .tokenizer import SPECIAL_TOKEN_CHOICES, SPECIAL_TOKENS_HELP, TOKENIZER_HELP, in_flags

#: Marks around supervised (loss_mask = 1) spans in the decoded text.
OPEN, CLOSE = "[[", "]]"


def first_rows(path: str | Path, n: int) -> list[tuple[str, int, Any]]:
    """``(file, row, payload)`` of the first ``n`` rows of a dataset file or folder, in order."""
    from ..sources.dataset import Dataset

    ds = Dataset.from_path(Path(path).name or "data", path)
    out: list[tuple[str, int, Any]] = []
    for shard, size in enumerate(ds.shard_sizes):
        take = min(size, n - len(out))
        if take <= 0:
            break
        name = ds.shard_path(shard) or ds.shard_ids[shard]
        out += [(name, i, p) for i, p in enumerate(ds.read(shard, list(range(take))))]
    return out


def build_operator(args: argparse.Namespace) -> Any:
    """The tokenizing operator the options describe, or ``None`` without a tokenizer.

    ``--tokenizer`` is loaded first (a path, else a Hugging Face id) and ``--special-tokens``
    defaults to what suits it (see :mod:`zephon.cli.tokenizer`).
    """
    from ..ops.chat import TokenizeChat, TokenizePromptCompletion
    from ..ops.tokenize import Tokenize
    from . import tokenizer as cli

    if args.tokenizer is None:
        if args.chat_template or args.prompt_field or args.completion_field:
            raise ValueError("--chat-template and --prompt-field/--completion-field need --tokenizer")
        return None
    handle = cli.load(args.tokenizer)
    if args.prompt_field or args.completion_field:
        return TokenizePromptCompletion(
            **cli.source_arguments(args.tokenizer),
            prompt_field=args.prompt_field or "prompt",
            completion_field=args.completion_field or "completion",
            special_tokens=cli.special_tokens(handle, args.special_tokens),
        )
    if args.chat or args.chat_template:  # the operator reads a template file itself
        return TokenizeChat(
            **cli.source_arguments(args.tokenizer), field=args.field or "messages",
            chat_template=args.chat_template, loss_scope=args.loss_scope,
        )
    return Tokenize(tokenizer=handle, field=args.field or "text", special_tokens=cli.special_tokens(handle, args.special_tokens))


def _describe_fields(payload: Any) -> str:
    if not isinstance(payload, dict):
        return type(payload).__name__
    parts = []
    for k, v in payload.items():
        if isinstance(v, str):
            parts.append(f"{k} (str, {len(v):,} chars)")
        elif isinstance(v, (list, tuple, np.ndarray)):
            parts.append(f"{k} ({type(v).__name__}, {len(v):,} items)")
        else:
            parts.append(f"{k} ({type(v).__name__})")
    return ", ".join(parts)


def _marked(tok: Any, ids: np.ndarray, mask: np.ndarray | None) -> str:
    """The decoded text, with supervised spans between :data:`OPEN` and :data:`CLOSE`."""
    if mask is None:
        return tok.decode(ids.tolist(), skip_special_tokens=False)
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or bool(mask[i]) != bool(mask[start]):
            text = tok.decode(ids[start:i].tolist(), skip_special_tokens=False)
            out.append(f"{OPEN}{text}{CLOSE}" if mask[start] else text)
            start = i
    return "".join(out)


def inspect_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One report per row: source, fields, and (with a tokenizer) tokens, masks and decoded text."""
    op = build_operator(args)
    tok = op.tokenizer.tokenizer if op is not None else None
    reports = []
    for file, row, payload in first_rows(args.path, args.n):
        rep: dict[str, Any] = {"file": str(file), "row": row, "fields": _describe_fields(payload)}
        reports.append(rep)
        if op is None:
            rep["payload"] = payload
            continue
        try:
            (outs,) = op.apply_many([payload])
        except Exception as exc:  # shown per row: checking the data is the point
            rep["error"] = f"{type(exc).__name__}: {in_flags(str(exc))}"
            continue
        rep["records"] = records = []
        for out in outs:
            ids = np.asarray(out["input_ids"])
            mask = np.asarray(out["loss_mask"]) if "loss_mask" in out else None
            first = [[int(t), tok.id_to_token(int(t)), None if mask is None else int(mask[i])]
                     for i, t in enumerate(ids[: args.tokens])]
            loss, text = None if mask is None else int(mask.sum()), _marked(tok, ids, mask)
            records.append(dict(tokens=len(ids), loss_tokens=loss, text=text, first_tokens=first))
    return reports


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit:,} more chars)"


def render(reports: list[dict[str, Any]], chars: int) -> str:
    lines = []
    for rep in reports:
        lines += [f"--- {rep['file']}, row {rep['row']} ---", f"fields: {rep['fields']}"]
        if "error" in rep:
            lines.append(f"error: {rep['error']}")
        if "payload" in rep:
            lines.append(_short(json.dumps(rep["payload"], ensure_ascii=False, default=str), chars))
        for i, rec in enumerate(rep.get("records", [])):
            head = f"record {i}: " if len(rep["records"]) > 1 else ""
            loss = "" if rec["loss_tokens"] is None else f", {rec['loss_tokens']:,} with loss ({OPEN}...{CLOSE} in the text)"
            lines.append(f"{head}{rec['tokens']:,} tokens{loss}")
            lines.append("text: " + _short(rec["text"], chars))
            cells = [f"{t}:{piece!r}" + ("" if m is None else f":{m}") for t, piece, m in rec["first_tokens"]]
            if cells:
                lines.append(f"first {len(cells)} tokens (id:token{'' if rec['loss_tokens'] is None else ':loss_mask'}): " + " ".join(cells))
        lines.append("")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    try:
        reports = inspect_rows(args)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        print(f"zephon inspect: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(reports, ensure_ascii=False, default=str, indent=1))
    else:
        print(render(reports, args.chars))
    return 1 if any("error" in r for r in reports) else 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show the first records of a dataset tokenized, decoded and with their loss masks",
        description=__doc__.split("\n\n")[1].replace("``", ""),
    )
    p.add_argument("path", help="a JSONL file (plain, .gz or .zst) or a folder of such shards")
    p.add_argument("--n", type=int, default=5, help="how many rows to show, from the start of the first shard (default 5)")
    p.add_argument("--tokenizer", help=f"{TOKENIZER_HELP}; without it rows are shown raw")
    p.add_argument("--field", help="the text field (default 'text'), or the conversation field with --chat (default 'messages')")
    p.add_argument("--chat", action="store_true", help="rows are conversations: render them with the chat template")
    p.add_argument(
        "--chat-template",
        help="'chatml', 'llama3', a Jinja template file, or a template string (implies --chat; default: the tokenizer's own)",
    )
    p.add_argument("--loss-scope", default="assistant", help="which turns carry loss with --chat (default 'assistant')")
    p.add_argument("--prompt-field", help="prompt/completion rows: the prompt field (loss on the completion only)")
    p.add_argument("--completion-field", help="prompt/completion rows: the completion field")
    p.add_argument("--special-tokens", choices=SPECIAL_TOKEN_CHOICES, help=f"{SPECIAL_TOKENS_HELP}; not used with --chat")
    p.add_argument("--tokens", type=int, default=24, help="how many leading tokens to list with ids and masks (default 24)")
    p.add_argument("--chars", type=int, default=1500, help="cut each decoded text after this many characters (default 1500)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON instead of text")
    p.set_defaults(func=_run)
