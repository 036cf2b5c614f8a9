"""A conversation for the engine: messages checked and flattened to text, and their rendering with
the model's chat template (tools offered through :mod:`..tool_calling`)."""
from __future__ import annotations

from dataclasses import dataclass

import jinja2

from ..tool_calling import render_chat_with_tools


@dataclass(slots=True)
class ChatPrompt:
    """A conversation that the engine renders with the model's chat template, then tokenizes.

    >>> ChatPrompt([{"role": "user", "content": "Hi!"}])

    Callers send it as the prompt of ``EngineCore.add_request``; the engine renders it on its
    thread (see ``input_processor``), so no caller renders a template or waits for the model.
    """

    messages: list[dict]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None  # offered to the model; see tool_calling.render_chat_with_tools

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        self.messages = [_text_message(index, message) for index, message in enumerate(self.messages)]
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict or None, "
                             f"got {type(self.chat_template_kwargs).__name__}")
        if self.tools is not None and not isinstance(self.tools, list):
            raise ValueError(f"tools must be a list or None, got {type(self.tools).__name__}")


def _text_message(index: int, message: object) -> dict:
    """The message with OpenAI-style text parts joined into one string (the engine is text-only)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise ValueError(f"messages[{index}] must be a dict with a non-empty string 'role', got {message!r:.80}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}]['content'] must be a string, a list of text parts or None, "
                         f"got {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}]['content']: only {{'type': 'text', 'text': ...}} parts are "
                             f"supported, got {part!r:.80}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def render_chat_prompt(tokenizer, prompt: ChatPrompt) -> str:
    """The conversation as the model's chat template renders it, with ``prompt.tools`` offered.

    Templates that know nothing of tools still show earlier tool calls and results, in the hermes
    convention (see :mod:`.tool_calling`).
    """
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    # transformers renders templates in jinja2's ImmutableSandboxedEnvironment: a template (which a
    # GGUF file or model repo supplies) cannot reach Python internals; its errors become ValueError here.
    try:
        return render_chat_with_tools(tokenizer, prompt.messages, prompt.tools, prompt.add_generation_prompt,
                                      prompt.chat_template_kwargs)
    except jinja2.exceptions.SecurityError as error:
        raise ValueError(f"chat template: refused an unsafe operation in the model's template ({error})") from error
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"messages: the model's chat template rejected the conversation ({error})") from error
