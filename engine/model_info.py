"""What callers may know about a loaded model, read once from the engine: the public facts the
integrations and the chat service need, so nothing above the engine reaches into ``LLMEngine``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts of a loaded model.

    >>> info = get_engine("default").model_info
    >>> info.model_type, info.max_model_len
    ('llama', 8192)
    """

    model: str                     # what the caller asked for ("default", a path, a hub id)
    architecture: str              # the HF class name our model code implements, e.g. "LlamaForCausalLM"
    model_type: str | None         # the HF config's model_type, e.g. "llama", "qwen3"
    max_model_len: int             # prompt plus output tokens one request may hold
    vocab_size: int
    chat_template: str | None      # the tokenizer's template; None when the model has none
    eos_token_ids: frozenset[int]

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None


def model_info_of(engine) -> ModelInfo:
    """The :class:`ModelInfo` of an :class:`~.llm_engine.LLMEngine` (called on the engine thread)."""
    return ModelInfo(
        model=engine.config.model,
        architecture=engine.arch.architecture,
        model_type=getattr(engine.hf_config, "model_type", None),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        chat_template=getattr(engine.tokenizer, "chat_template", None),
        eos_token_ids=frozenset(engine.eos_token_ids),
    )
