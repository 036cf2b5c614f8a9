"""Decoder models in the embedding engine, run by the LLM engine's own model code
(:class:`hearth_llm.engine.pooling.DecoderPooler`: final hidden states, no KV cache kept).

* Embedding models (Qwen3-Embedding): the pooling their sentence-transformers files name — last
  token for Qwen3-Embedding, whose tokenizer ends every text with ``<|endoftext|>`` — then
  Normalize and Matryoshka ``dimensions`` as for the encoders; prompts (``"query"``: an
  ``Instruct: ...\\nQuery:`` line) from ``config_sentence_transformers.json``.
* LLM rerankers (Qwen3-Reranker, ``task="score"``): each (query, document) pair is written into
  the model's judging prompt and scored by the probability of "yes" against "no" as the next
  token, as Qwen3-Reranker's model card computes it.

Sequences run unpadded (one flat batch), so tokenizers' left padding changes nothing here.
"""
from __future__ import annotations

import json

import torch

from hearth_llm.engine.pooling import DecoderPooler, check_poolable

from .config import EmbeddingConfig
from .model_dir import EncoderSpec
from .pooling import pool_packed
from .runner import EncoderRunner

# Qwen3-Reranker's prompt (its model card): a system turn that asks for "yes" or "no", the pair in
# the user turn, and an assistant turn opened after an empty thinking block.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES_TOKEN, NO_TOKEN = "yes", "no"


def rerank_text(query: str, document: str, instruction: str | None = None) -> str:
    """The pair as Qwen3-Reranker reads it between :data:`RERANK_PREFIX` and :data:`RERANK_SUFFIX`.

    >>> rerank_text("Where is Paris?", "Paris is in France.")
    '<Instruct>: Given a web search query, ...\\n<Query>: Where is Paris?\\n<Document>: Paris is in France.'
    """
    return (f"<Instruct>: {instruction if instruction is not None else DEFAULT_RERANK_INSTRUCTION}\n"
            f"<Query>: {query}\n<Document>: {document}")


def why_not_our_decoder(spec: EncoderSpec) -> str | None:
    """Why the LLM engine's model code cannot run ``spec``'s decoder, or None."""
    from transformers import AutoConfig

    from .bert import has_safetensors

    if not has_safetensors(spec.encoder_path):
        return "it has no safetensors weights"
    try:
        check_poolable(AutoConfig.from_pretrained(str(spec.encoder_path), trust_remote_code=False))
    except (ValueError, KeyError) as error:
        return str(error)
    return None


class DecoderEmbeddingRunner(EncoderRunner):
    """Texts → token ids → the decoder's final hidden states → pooled (and normalized) vectors.

    >>> runner = DecoderEmbeddingRunner(read_encoder_spec("/models/Qwen3-Embedding-0.6B"), EmbeddingConfig())
    >>> ids, _ = runner.tokenize(["Paris is in France."], truncate=True)
    >>> runner.run(ids).shape
    torch.Size([1, 1024])
    """

    with_logits = False

    def __init__(self, spec: EncoderSpec, config: EmbeddingConfig) -> None:   # noqa: D107 - no encoder load
        self.spec = spec
        self.device = config.torch_device
        self.implementation = "hearth"
        self.pooler = DecoderPooler.from_pretrained(spec.encoder_path, self.device, config.torch_dtype,
                                                    with_logits=self.with_logits)
        self.model = self.pooler.model
        self.tokenizer = self.pooler.tokenizer
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)

    @property
    def is_mixed_precision(self) -> bool:
        return False

    def tokenize(self, texts: list, truncate: bool) -> tuple[list[list[int]], list[bool]]:
        """As the encoders'; a text with no tokens at all (``""`` where the tokenizer adds no end
        token) raises, and the engine then fails only that text's request."""
        token_ids, is_too_long = super().tokenize(texts, truncate)
        if not all(token_ids):
            raise ValueError("the text has no tokens (this tokenizer adds no special token to an empty text)")
        return token_ids, is_too_long

    def _compute(self, token_ids: list[list[int]]) -> torch.Tensor:
        hidden, bounds = self.pooler.hidden_states(token_ids)
        dimensions = self.spec.dimension if self.spec.is_truncated else None
        return pool_packed(hidden, bounds, self.spec.pooling, self.spec.normalize, dimensions)


class LLMRerankerRunner(DecoderEmbeddingRunner):
    """(query, document, instruction) → Qwen3-Reranker's prompt → P("yes") at the last position,
    from the softmax over the "yes" and "no" logits; ``[len(pairs), 1]``.

    >>> runner = LLMRerankerRunner(read_encoder_spec("/models/Qwen3-Reranker-0.6B", task="score"), EmbeddingConfig())
    >>> ids, _ = runner.tokenize([("Where is Paris?", "Paris is in France.", None)], truncate=True)
    >>> runner.run(ids)            # tensor([[0.99...]])
    """

    with_logits = True

    def __init__(self, spec: EncoderSpec, config: EmbeddingConfig) -> None:
        super().__init__(spec, config)
        self.yes_no_ids = [_single_token_id(self.tokenizer, NO_TOKEN), _single_token_id(self.tokenizer, YES_TOKEN)]
        self.prefix_ids = self.tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
        self.suffix_ids = self.tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
        if len(self.prefix_ids) + len(self.suffix_ids) >= spec.max_seq_length:
            raise ValueError(f"max_seq_length={spec.max_seq_length} leaves no room for the pair: the reranker's "
                             f"prompt alone is {len(self.prefix_ids) + len(self.suffix_ids)} tokens")

    def _compute(self, token_ids: list[list[int]]) -> torch.Tensor:
        no_yes = self.pooler.last_logits(token_ids, self.yes_no_ids)
        return torch.softmax(no_yes, dim=1)[:, 1:]

    def _encode(self, pairs: list[tuple[str, str, str | None]], max_length: int) -> list[list[int]]:
        """The model card's recipe: the pair's text truncated to what the prompt leaves, then
        prompt tokens before and after."""
        room = max_length - len(self.prefix_ids) - len(self.suffix_ids)
        texts = [rerank_text(query, document, instruction) for query, document, instruction in pairs]
        body = self.tokenizer(texts, truncation=True, max_length=room, return_attention_mask=False,
                              return_token_type_ids=False)["input_ids"]
        return [self.prefix_ids + row + self.suffix_ids for row in body]


def _single_token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"an LLM reranker's tokenizer needs a {token!r} token (scored against "
                         f"{json.dumps(YES_TOKEN if token == NO_TOKEN else NO_TOKEN)}); this one has none")
    return int(token_id)

