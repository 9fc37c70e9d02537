"""The tiktoken fast path: an exact ``tiktoken.Encoding`` for GPT-2 style byte-level BPE.

:func:`_tiktoken_plan` checks a spec and makes tiktoken's inputs, :func:`_verify_tiktoken` proves
the encoding gives the ``tokenizers`` ids; :mod:`zephon.text.tokenizer` chooses the backend.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.cache import ProcessCache

logger = logging.getLogger("zephon")

#: The pre-tokenization regex of GPT-2, as ``tokenizers``' ByteLevel pre-tokenizer applies it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Whether tiktoken imports in this process; cleared after fork, so each process warns once.
_USABLE = ProcessCache()


def _tiktoken_available() -> bool:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return True


def _tiktoken_usable() -> bool:
    """Whether this process can run the tiktoken backend (warns once per process when not)."""

    def check() -> bool:
        if _tiktoken_available():
            return True
        logger.warning("tiktoken is not installed in this process; encoding with tokenizers (same ids)")
        return False

    return _USABLE.get("tiktoken", check)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table (each byte is shown as one printable char)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # shown as chr(256), chr(257), ...
    chars = printable + list(range(256, 256 + len(others)))
    return {chr(c): b for b, c in zip(printable + others, chars)}


def _tiktoken_plan(spec: dict) -> tuple[dict | None, str]:
    """``(tiktoken's inputs, "")`` for a GPT-2 style byte-level BPE, else ``(None, reason)``: the
    checks make tiktoken's merges (lowest id first) coincide with ``tokenizers``' (lowest rank)."""
    if spec.get("normalizer") is not None:
        return None, f"it has a normalizer ({spec['normalizer'].get('type')})"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None, "its ByteLevel pre-tokenizer adds a prefix space or has no regex"
        pattern = GPT2_PATTERN
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        isolated = split.get("type") == "Split" and regex is not None and split.get("behavior") == "Isolated"
        plain = byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
        if not isolated or split.get("invert") or not plain or byte_level.get("use_regex"):
            return None, "its pre-tokenizer is not Split(regex, isolated) + ByteLevel"
        pattern = regex
    else:
        return None, f"its pre-tokenizer is {pre.get('type')!r}, not GPT-2's byte-level one"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"its model is {model.get('type')!r}, not BPE"
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "its BPE uses dropout or subword prefixes/suffixes"
    added = spec.get("added_tokens") or []
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return None, f"added token {t['content']!r} strips spaces or matches single words only"
    contents = [t["content"] for t in added]
    for a in contents:
        for b in contents:
            if a != b and b.startswith(a):
                return None, f"added tokens {a!r} and {b!r} overlap"
    # Map each byte-level char to the latin-1 char of its byte; chars outside the alphabet are
    # deleted (U+0000-U+00FF) or fail to encode (above), and either way the entry is rejected.
    table = {c: None for c in range(256)}
    table.update({ord(ch): chr(b) for ch, b in _byte_decoder().items()})
    vocab: dict[str, int] = model.get("vocab") or {}
    added_ids = {t["content"]: t["id"] for t in added}
    ranks: dict[bytes, int] = {}
    for token, tid in vocab.items():
        if token in added_ids:
            continue
        mapped = token.translate(table)
        try:
            if len(mapped) != len(token):
                raise UnicodeError
            ranks[mapped.encode("latin-1")] = tid
        except UnicodeError:
            return None, f"vocabulary entry {token!r} is not byte-level"
    if len(ranks) != len(vocab) - sum(1 for t in vocab if t in added_ids):
        return None, "two vocabulary entries decode to the same bytes"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not every single byte has a token"
    merged: set[str] = set()
    last = -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tid = vocab.get(a + b)
        if tid is None or tid <= last:
            return None, "its merge order does not follow its token ids"
        last = tid
        merged.add(a + b)
    multi = {t for t in vocab if t not in added_ids and len(t) > 1}
    if multi - merged:
        return None, f"{len(multi - merged)} multi-byte tokens are produced by no merge"
    if merged & set(added_ids):
        return None, "an added token is also produced by a merge"
    if len(set(added_ids.values())) != len(added_ids) or set(added_ids.values()) & set(ranks.values()):
        return None, "added token ids collide with vocabulary ids"
    plan = {"pattern": pattern, "ranks": ranks, "specials": added_ids, "vocab": vocab}
    return {**plan, "ignore_merges": bool(model.get("ignore_merges"))}, ""


def _build_tiktoken(plan: dict, digest: str) -> Any:
    import tiktoken

    name, ranks, specials = f"zephon-{digest[:16]}", plan["ranks"], plan["specials"]
    return tiktoken.Encoding(name, pat_str=plan["pattern"], mergeable_ranks=ranks, special_tokens=specials)


def _verification_texts() -> list[str]:
    """Varied text for checking an alternative encoder against ``tokenizers``."""
    texts = [
        "",
        " ",
        "Hello, world! It's a test: don't, I'll, we've, you're, she'd, I'm, THEY'RE, O'Neil's.",
        "  leading and trailing spaces   ",
        "tabs\tand\t\tnewlines\n\n\nand\r\ncarriage returns\r   \n \t \n",
        "numbers 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 2024-01-31 12:30:45",
        "Ünïcödé: café naïve façade Straße ÆØÅ æøå ñ ç œ İstanbul ǅ",
        "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
        "Русский текст, Ελληνικά, עברית, العربية, हिन्दी, ไทย, ქართული",
        "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✨ 🧑🏻‍💻 #️⃣",
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\tif x:\n\t\tpass\n",
        '{"key": "value", "list": [true, false, null], "nested": {"n": -1.5e3}}',
        "int main(void) { printf(\"%d\\n\", a[i++] >> 2 && b != c); return 0; }",
        "<html><body class=\"x\">&amp; &lt;tag&gt; https://example.com/path?q=1&r=two#frag</body></html>",
        "punctuation!!! ??? ... --- *** ___ ~~~ ``` ''' \"\"\" ((())) [[[]]] {{{}}} ;;; ::: ,,, ///",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "          many spaces          then words          ",
        "nbsp\u00a0here\u2003em space\u3000ideographic\u200bzero-width\ufeffbom",
        "mixedCASE camelCase snake_case kebab-case SCREAMING_CASE PascalCase x1y2z3",
        "end with newline\n",
        "<|endoftext|>",
        "text<|endoftext|>more text <|endoftext|> and again<|endoftext|>",
        "\x00\x01\x02 control \x1b[31m colors \x7f",
    ]
    sweep = "".join(chr(c) for c in range(0x20, 0x3400, 3) if not 0xD800 <= c < 0xE000)
    texts.append(sweep)
    texts.append(" ".join(sweep[i : i + 7] for i in range(0, len(sweep), 7)))
    texts.append("\n".join(texts))
    return texts


def _verify_tiktoken(tok: Any, encoding: Any, plan: dict, encode_special_tokens: bool) -> str:
    """``""`` when tiktoken reproduced ``tokenizers`` on the sample and every vocabulary entry."""
    texts = _verification_texts()
    # One by one: a batch call would start the thread pool, disabling it in forked children.
    expected = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    allowed = frozenset() if encode_special_tokens else encoding.special_tokens_set
    for text, ids in zip(texts, expected):
        got = encoding.encode(text, allowed_special=allowed, disallowed_special=())
        if got != ids:
            return f"its ids differ from tokenizers on the sample text {text[:40]!r}"
    if not plan["ignore_merges"]:
        # tiktoken keeps a piece that is a whole token; tokenizers must reach it by merges.
        model = tok.model
        for token, tid in plan["vocab"].items():
            if token in plan["specials"]:
                continue
            pieces = model.tokenize(token)
            if len(pieces) != 1 or pieces[0].id != tid:
                return f"tokenizers does not merge the vocabulary entry {token!r} into one token"
    return ""
