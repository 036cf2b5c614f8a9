"""Tokenizer and encoder of one model: texts → token ids → embeddings. Used by the engine thread only."""
from __future__ import annotations

import json
import logging

import torch

from .bert import MIXED_PRECISION_MIN_TOKENS, PackedLayout, has_safetensors
from .config import EmbeddingConfig
from .cross_encoder import SCORE_ACTIVATIONS, CrossEncoder, pair_token_types
from .encoders import BERT_MODEL_TYPES, SUPPORTED_MODEL_TYPES, check_config, encoder_class
from .model_dir import EncoderSpec
from .pooling import pool

logger = logging.getLogger("hearth_llm")

# What the mixed-precision check at load embeds both ways: prose, a question, lists, numbers, code,
# other scripts, a one-word text and one long enough to be truncated.
CALIBRATION_TEXTS = (
    "The kettle switches itself off when the water boils or when it is lifted from its base.",
    "How do I descale a kettle with citric acid?",
    "Ingredients: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt. Whisk until smooth.",
    "Revenue rose 4.7% to $12.3 billion in Q3 2024, while operating costs fell by 1.2%.",
    "def mean(values): return sum(values) / len(values) if values else 0.0",
    "Der schnelle braune Fuchs springt über den faulen Hund. 東京は日本の首都です。",
    "yes",
    "Photosynthesis converts light energy into chemical energy stored in glucose. " * 12,
    "Customer reported that the app crashes on login after the latest update; reinstalling did not help.",
    "A quiet harbour at dawn, gulls circling over the fishing boats as the fog lifts.",
)
# The engine promises cosine >= 0.99999 to the float32 model; the check asks for half that error on
# the texts above, keeping the other half in reserve for texts unlike them.
MIXED_PRECISION_MIN_COSINE = 0.999995


class EncoderRunner:
    """Loads the tokenizer and the encoder (ours or transformers', per ``config.implementation``).

    >>> runner = EncoderRunner(read_encoder_spec("default"), EmbeddingConfig())
    >>> ids, is_too_long = runner.tokenize(["Hello world"], truncate=True)
    >>> runner.run(ids).shape
    torch.Size([1, 384])
    """

    def __init__(self, spec: EncoderSpec, config: EmbeddingConfig) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.device = config.torch_device
        self.tokenizer = AutoTokenizer.from_pretrained(str(spec.encoder_path))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        self.implementation = choose_implementation(spec, config.implementation)
        if self.implementation == "hearth":
            self.model = self._our_model_class().from_pretrained(spec.encoder_path, dtype=config.torch_dtype,
                                                                 device=self.device)
            if config.allows_mixed_precision and self._offers_mixed:
                self._use_mixed_precision_if_close()
            if config.compile and self._offers_compiled and self.model.use_compiled_blocks():
                self._compile_now()
        else:
            self.model = _load_transformers_model(spec, config)

    def _our_model_class(self):
        return encoder_class(self.spec.model_type)

    @property
    def _offers_mixed(self) -> bool:
        """Only the BERT encoder's mixed precision is calibrated (see bert.py)."""
        return self.spec.model_type in BERT_MODEL_TYPES

    @property
    def _offers_compiled(self) -> bool:
        """Only the BERT-family encoder has a compiled block (see compiled_block.py)."""
        return self.spec.model_type in BERT_MODEL_TYPES

    def _compile_now(self) -> None:
        """Compile at load rather than in the first request: embed a few texts. If compiling fails
        (a compiler toolchain missing on this machine...), the encoder stays eager."""
        token_ids, _ = self.tokenize(list(CALIBRATION_TEXTS[:4]), truncate=True)
        try:
            with torch.inference_mode():
                self.run(token_ids)
        except Exception as error:  # noqa: BLE001 - the eager path is always there
            logger.warning("compiling the embedding encoder failed (%s: %s); it runs eagerly",
                           type(error).__name__, str(error)[:500])
            self.model.use_compiled_blocks(enabled=False)

    @property
    def is_mixed_precision(self) -> bool:
        return self.implementation == "hearth" and self.model.is_mixed_precision

    @property
    def precision(self) -> str:
        """``"float32"``, ``"bfloat16"``, ... or ``"mixed float32/bfloat16"``."""
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return f"mixed {dtype}/bfloat16" if self.is_mixed_precision else dtype

    @property
    def float32_below_length(self) -> int:
        """Batches with a text of fewer tokens run in float32 (0: precision never depends on length)."""
        return MIXED_PRECISION_MIN_TOKENS if self.is_mixed_precision else 0

    def _use_mixed_precision_if_close(self) -> None:
        """Switch our encoder to mixed precision if, on :data:`CALIBRATION_TEXTS`, every embedding
        stays within :data:`MIXED_PRECISION_MIN_COSINE` of the float32 one; else stay float32."""
        token_ids, _ = self.tokenize(list(CALIBRATION_TEXTS), truncate=True)
        with torch.inference_mode():
            exact = self.run(token_ids)
            self.model.prepack(mixed_precision=True)
            if not self.model.is_mixed_precision:    # no bf16 matmuls on this CPU
                return
            worst = torch.nn.functional.cosine_similarity(self.run(token_ids), exact, dim=1).min().item()
        if worst < MIXED_PRECISION_MIN_COSINE:
            logger.info("embedding model %s stays float32: mixed precision reached cosine %.7f < %.7f",
                        self.spec.encoder_path, worst, MIXED_PRECISION_MIN_COSINE)
            self.model.prepack()

    def tokenize(self, texts: list[str], truncate: bool) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each text (special tokens included) and whether it was longer than
        ``max_seq_length``; over-long texts are truncated when ``truncate``, else left cut at
        ``max_seq_length + 1`` for the caller to refuse. With ``truncate`` the flag says whether the
        text reached ``max_seq_length`` (it may have been cut there): that mode encodes once."""
        if self.spec.do_lower_case:
            texts = [text.lower() for text in texts]
        limit = self.spec.max_seq_length
        if truncate:
            # One pass (this used to encode at limit + 1, then again at limit the texts found too
            # long): a text within the limit encodes the same either way, and nobody refuses the others.
            ids = self._encode(texts, limit)
            return ids, [len(row) >= limit for row in ids]
        ids = self._encode(texts, limit + 1)
        return ids, [len(row) > limit for row in ids]

    def run(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Right-pad one batch, encode, pool: float32 ``[len(token_ids), dimension]`` on the CPU."""
        return self._compute(token_ids).cpu()

    def launch(self, token_ids: list[list[int]]) -> PendingRows:
        """:meth:`run` without waiting for the device: the rows come back through ``.wait()``. On
        CUDA the host is free as soon as the work is queued, to prepare and queue the next batch."""
        return PendingRows(self._compute(token_ids))

    def _compute(self, token_ids: list[list[int]]) -> torch.Tensor:
        """:meth:`run`'s rows, still on the device (nothing here waits for it)."""
        input_ids, attention_mask = self._padded(token_ids)
        if self.implementation == "hearth":
            layout = PackedLayout.from_lengths([len(row) for row in token_ids], self.device)
            hidden = self.model(input_ids, attention_mask, layout=layout)
        else:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        dimensions = self.spec.dimension if self.spec.is_truncated else None
        return pool(hidden, attention_mask, self.spec.pooling, self.spec.normalize, dimensions)

    def _padded(self, token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` (pad id where padded) and ``attention_mask``, ``[batch, longest]``, on the device."""
        lengths = [len(row) for row in token_ids]
        length = max(lengths)
        pad = [self.pad_token_id]
        input_ids = torch.tensor([row + pad * (length - len(row)) for row in token_ids], dtype=torch.long)
        attention_mask = (torch.arange(length) < torch.tensor(lengths).unsqueeze(1)).long()
        if self.device.type == "cuda":   # non-blocking from pinned memory: the host does not wait for the device
            return (input_ids.pin_memory().to(self.device, non_blocking=True),
                    attention_mask.pin_memory().to(self.device, non_blocking=True))
        return input_ids, attention_mask

    def _encode(self, texts: list[str], max_length: int) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length,
                              return_attention_mask=False, return_token_type_ids=False)["input_ids"]


class PendingRows:
    """A batch's result on its way to the host: on CUDA a pinned host tensor that a non-blocking
    copy fills, and the event recorded after it; elsewhere the result itself.

    >>> pending = PendingRows(rows_on_device)       # returns at once
    >>> pending.wait()                               # float32 [batch, dimension] on the CPU
    """

    def __init__(self, rows: torch.Tensor) -> None:
        self._event = None
        if rows.is_cuda:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            rows = host
        self._rows = rows

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._rows


# Model types whose hub configs carry fields (nomic's prenorm, biases, rotary variants...) that
# transformers' own implementation never reads: a config we refuse would run wrongly there too.
CONFIG_FIELDS_TRANSFORMERS_IGNORES = ("nomic_bert",)


def choose_implementation(spec: EncoderSpec, requested: str) -> str:
    """``"hearth"`` (ours) or ``"transformers"``. "auto" takes ours wherever it can run the model:
    on all-MiniLM-L6-v2, one CPU thread, 1000 sentences, it spent 5.6 CPU-s where sentence-transformers
    (``AutoModel`` with SDPA, batches of 32) spent 7.4–7.7, at the same accuracy: its dense layers
    run at oneDNN's fp32 peak (~110 GFLOP/s a core) on unpadded tokens."""
    if spec.is_decoder:
        return _choose_decoder_implementation(spec, requested)
    reason = _why_not_ours(spec)
    if reason and requested != "hearth" and spec.model_type in CONFIG_FIELDS_TRANSFORMERS_IGNORES:
        raise ValueError(f"{spec.encoder_path} cannot run exactly: {reason} (transformers' {spec.model_type} "
                         "ignores that field, so it is no fallback)")
    if requested == "hearth" and reason:
        raise ValueError(f"implementation='hearth' cannot run {spec.encoder_path}: {reason}; "
                         "use implementation='transformers' or 'auto'")
    if requested == "auto":
        if reason:
            logger.info("embedding model %s runs on transformers: %s", spec.encoder_path, reason)
        return "transformers" if reason else "hearth"
    return requested


def _choose_decoder_implementation(spec: EncoderSpec, requested: str) -> str:
    """A decoder runs on the LLM engine's model code; transformers' ``AutoModel`` (right-padded, so
    the mask finds the last token) only embeds, for an architecture or config field we refuse."""
    from .decoder import why_not_our_decoder

    if requested == "transformers":
        if spec.is_llm_reranker:
            raise ValueError("implementation='transformers' does not run LLM rerankers; use 'auto' or 'hearth'")
        return requested
    reason = why_not_our_decoder(spec)
    if reason is None:
        return "hearth"
    if requested == "hearth" or spec.is_llm_reranker:
        raise ValueError(f"the LLM engine cannot run {spec.encoder_path}: {reason}")
    logger.info("embedding model %s runs on transformers: %s", spec.encoder_path, reason)
    return "transformers"


def _why_not_ours(spec: EncoderSpec) -> str | None:
    supported = BERT_MODEL_TYPES if spec.is_cross_encoder else SUPPORTED_MODEL_TYPES
    if spec.model_type not in supported:
        return f"model_type {spec.model_type!r} is not one of {supported}" + (" (for a cross-encoder)"
                                                                            if spec.is_cross_encoder else "")
    if not has_safetensors(spec.encoder_path):
        return "it has no safetensors weights"
    with open(spec.encoder_path / "config.json", encoding="utf-8") as file:
        try:
            check_config(json.load(file))
        except (ValueError, KeyError) as error:
            return str(error)
    return None


def _load_transformers_model(spec: EncoderSpec, config: EmbeddingConfig):
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto_class = AutoModelForSequenceClassification if spec.is_cross_encoder else AutoModel
    model = auto_class.from_pretrained(str(spec.encoder_path), dtype=config.torch_dtype, attn_implementation="sdpa")
    model.to(config.torch_device).eval()
    model.requires_grad_(False)
    return model


class CrossEncoderRunner(EncoderRunner):
    """:class:`EncoderRunner` for a cross-encoder: (query, document) pairs → one score each,
    the logit through the activation sentence-transformers' ``CrossEncoder`` applies.

    >>> runner = CrossEncoderRunner(read_encoder_spec(reranker_dir), EmbeddingConfig())
    >>> ids, _ = runner.tokenize([("what is a kettle?", "A kettle boils water.")], truncate=True)
    >>> runner.run(ids).shape
    torch.Size([1, 1])
    """

    def _our_model_class(self):
        return CrossEncoder

    @property
    def _offers_mixed(self) -> bool:
        return False

    @property
    def _offers_compiled(self) -> bool:
        return False

    def _compute(self, token_ids: list[list[int]]) -> torch.Tensor:
        input_ids, attention_mask = self._padded(token_ids)
        if self.implementation == "hearth":
            types = None
            if self.model.encoder.config.type_vocab_size > 1:
                types = pair_token_types(input_ids, attention_mask, self.tokenizer.sep_token_id)
            logits = self.model(input_ids, attention_mask, types)
        else:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                **self._transformers_token_types(input_ids, attention_mask)).logits[:, 0]
        return SCORE_ACTIVATIONS[self.spec.score_activation](logits.float()).unsqueeze(1)

    def _transformers_token_types(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        if getattr(self.model.config, "type_vocab_size", 1) > 1:
            return {"token_type_ids": pair_token_types(input_ids, attention_mask, self.tokenizer.sep_token_id)}
        return {}

    def _encode(self, pairs: list[tuple[str, str]], max_length: int) -> list[list[int]]:
        queries, documents = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        return self.tokenizer(queries, documents, add_special_tokens=True, truncation=True, max_length=max_length,
                              return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def make_runner(spec: EncoderSpec, config: EmbeddingConfig) -> EncoderRunner:
    """The runner for ``spec``: embeddings, or scores for a cross-encoder; a decoder's on the LLM
    engine's model code (embeddings/decoder.py)."""
    if spec.is_decoder and choose_implementation(spec, config.implementation) == "hearth":
        from .decoder import DecoderEmbeddingRunner, LLMRerankerRunner

        return (LLMRerankerRunner if spec.is_llm_reranker else DecoderEmbeddingRunner)(spec, config)
    return (CrossEncoderRunner if spec.is_cross_encoder else EncoderRunner)(spec, config)
