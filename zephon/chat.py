"""Chat templates: rendering, generation tags, special markers, and character spans to token masks.

The operators are :class:`zephon.ops.TokenizeChat` and :class:`zephon.ops.TokenizePromptCompletion`
(``Pipeline.tokenize_chat`` and ``Pipeline.tokenize(prompt_field=..., completion_field=...)``).
Needs ``jinja2`` (``pip install zephon-lanes[chat]``).
"""

from .text.templates import BUILTIN_TEMPLATES as BUILTIN_TEMPLATES
from .text.templates import CHATML_TEMPLATE as CHATML_TEMPLATE
from .text.templates import LLAMA3_TEMPLATE as LLAMA3_TEMPLATE
from .text.templates import has_generation_tags as has_generation_tags
from .text.templates import render_chat as render_chat
from .text.templates import spans_to_mask as spans_to_mask
from .text.templates import strip_generation_tags as strip_generation_tags
from .text.templates import template_markers as template_markers

__all__ = [
    "BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "LLAMA3_TEMPLATE", "has_generation_tags", "render_chat", "spans_to_mask",
    "strip_generation_tags", "template_markers",
]
