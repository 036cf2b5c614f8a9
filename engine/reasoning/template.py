"""What a chat template says about thinking: the switch that turns it on or off, and whether the
rendered prompt already opened the think block."""
from __future__ import annotations

import re

_SWITCHES = (
    ("enable_thinking", re.compile(r"\benable_thinking\b")),                      # Qwen3, SmolLM3
    ("thinking", re.compile(r"\{%-?\s*(?:if|elif)\s+(?:not\s+)?thinking\b")),   # Granite 3.2, DeepSeek-V3.1
)


def thinking_switch(chat_template: str | None) -> str | None:
    """The template variable that turns thinking on or off; None when it has none.

    >>> thinking_switch("{%- if enable_thinking is false %}<think>\\n\\n</think>{% endif %}")
    'enable_thinking'
    >>> thinking_switch("{{ messages }}") is None
    True
    """
    for name, pattern in _SWITCHES:
        if chat_template and pattern.search(chat_template):
            return name
    return None


def prompt_opens_block(prompt: str, start_tag: str, end_tag: str) -> bool:
    """Whether ``prompt`` ends inside an open think block (the model continues its thinking).

    >>> prompt_opens_block("<｜Assistant｜><think>\\n", "<think>", "</think>")
    True
    >>> prompt_opens_block("<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n", "<think>", "</think>")
    False
    """
    start = prompt.rfind(start_tag)
    return start != -1 and prompt.find(end_tag, start) == -1 and prompt[start + len(start_tag):].strip() == ""


def template_opens_block(chat_template: str, messages: list[dict], chat_template_kwargs: dict | None,
                         start_tag: str, end_tag: str) -> bool:
    """Whether the template's generation prompt for ``messages`` opens the think block.

    Renders the template the way transformers does (its sandbox, its helpers); a template that
    cannot be rendered without the tokenizer's special tokens counts as not opening it.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template([messages], chat_template=chat_template, add_generation_prompt=True,
                                            **(chat_template_kwargs or {}))
    except Exception:  # the engine renders it for real and reports the template's errors
        return False
    return prompt_opens_block(rendered[0], start_tag, end_tag)
