"""Chat templates: rendering, generation tags, and character spans to token masks.

The operators are :class:`zephon.ops.TokenizeChat` and :class:`zephon.ops.TokenizePromptCompletion`
(``Pipeline.tokenize_chat`` and ``Pipeline.tokenize(prompt_field=..., completion_field=...)``).
Needs ``jinja2`` (``pip install zephon[chat]``).
"""

from ._chat import BUILTIN_TEMPLATES as BUILTIN_TEMPLATES
from ._chat import CHATML_TEMPLATE as CHATML_TEMPLATE
from ._chat import LLAMA3_TEMPLATE as LLAMA3_TEMPLATE
from ._chat import has_generation_tags as has_generation_tags
from ._chat import render_chat as render_chat
from ._chat import spans_to_mask as spans_to_mask
from ._chat import strip_generation_tags as strip_generation_tags

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHATML_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "has_generation_tags",
    "render_chat",
    "spans_to_mask",
    "strip_generation_tags",
]
