"""The chat layer below the integrations: a :class:`ChatRequest` in, :class:`ChatDelta`s and a
:class:`ChatResult` out, through :class:`ChatService`; conversations reach the engine as
:class:`ChatPrompt`s, which it renders with the model's chat template. A thinking model's think
block is split from the answer (``ChatResult.reasoning``, ``ChatDelta.reasoning``); a budget for
it, or a grammar after it, runs as two engine requests read as one (:mod:`.thinking`).

>>> from hearth_llm.engine.chat import ChatRequest, ChatService, SamplingOptions
>>> service = ChatService(get_engine("default"))
>>> service.chat(ChatRequest([{"role": "user", "content": "Hi!"}], sampling=SamplingOptions(max_tokens=8))).content
"""
from .prompt import ChatPrompt, render_chat_prompt
from .request import ChatRequest, SamplingOptions
from .result import ChatDelta, ChatResult, ChatUsage, logprob_entry
from .service import ChatService
from .stream import ChatStream

__all__ = ["ChatPrompt", "render_chat_prompt", "ChatRequest", "SamplingOptions", "ChatDelta", "ChatResult",
           "ChatUsage", "ChatService", "ChatStream", "logprob_entry"]
