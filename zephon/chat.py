"""Chat templates: rendering, generation tags, special markers, and character spans to token masks.

The operators are :class:`zephon.ops.TokenizeChat` and :class:`zephon.ops.TokenizePromptCompletion`.
Needs ``jinja2`` (``pip install zephon-lanes[chat]``).
"""

from .text.templates import BUILTIN_TEMPLATES, CHATML_TEMPLATE, LLAMA3_TEMPLATE, has_generation_tags
from .text.templates import render_chat, spans_to_mask, strip_generation_tags, template_markers

__all__ = [
    "BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "LLAMA3_TEMPLATE", "has_generation_tags", "render_chat", "spans_to_mask",
    "strip_generation_tags", "template_markers",
]
