"""Tiny random embedding and reranker directories, written without sentence-transformers (HF
``save_pretrained`` plus :func:`~hearth_llm.embeddings.model_dir.write_pipeline_files`), so the
bf16 and GPU tests run where it is not installed; tests that compare against it load them with it.
The encoders get the bundled MiniLM tokenizer, or where that package is not installed (the GPU
box) a WordPiece tokenizer built in code (:func:`hearth_llm.benchmarks.embeddings.write_bert_tokenizer`).

>>> path = write_encoder(tmp_path, "modernbert", "mean")          # Transformer → Pooling → Normalize
>>> path = write_encoder(tmp_path, "bert", "mean")                # all-MiniLM-L6-v2's pipeline, tiny
>>> path = write_qwen3_embedding(tmp_path)                        # the Qwen3-Embedding shape
>>> path = write_qwen3_reranker(tmp_path)                         # the Qwen3-Reranker shape
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig,
                          ModernBertConfig, NomicBertConfig, PreTrainedTokenizerFast, Qwen3Config, XLMRobertaConfig)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hearth_llm.benchmarks.embeddings import write_bert_tokenizer
from hearth_llm.embeddings.model_dir import write_pipeline_files

ENCODER_COMMON = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=48)
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QWEN_MERGES = [("y", "e"), ("ye", "s"), ("n", "o"), ("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]


def encoder_config(kind: str):
    if kind == "bert":       # all-MiniLM-L6-v2's architecture (BertModel), at the tiny size
        return BertConfig(**ENCODER_COMMON, max_position_embeddings=512, pad_token_id=0, type_vocab_size=2)
    if kind == "xlm-roberta":
        return XLMRobertaConfig(**ENCODER_COMMON, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
    if kind == "nomic_bert":
        return NomicBertConfig(**ENCODER_COMMON, max_position_embeddings=128, pad_token_id=0,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    # two bases and a window narrower than most texts, so local layers differ from global ones
    return ModernBertConfig(**ENCODER_COMMON, max_position_embeddings=128, pad_token_id=0, bos_token_id=101,
                            eos_token_id=102, cls_token_id=101, sep_token_id=102, local_attention=8,
                            global_attn_every_n_layers=2, global_rope_theta=160000.0, local_rope_theta=10000.0)


def random_encoder(kind: str):
    """A random HF encoder of ``kind`` (seeded) whose norms and attention make mistakes show."""
    torch.manual_seed(3)
    model = AutoModel.from_config(encoder_config(kind))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():       # non-trivial norms, so that a norm in the wrong place shows
                param.add_(0.3 * torch.randn_like(param))
            if any(part in name for part in ("Wqkv", "q_proj", "k_proj", "query", "key")):
                param.mul_(6.0)              # peaked attention, so that positions and windows matter
    return model


def write_encoder(path: Path, kind: str, pooling: str = "mean", normalize: bool = True) -> Path:
    """A random encoder of ``kind`` with a BERT tokenizer (the bundled MiniLM's where installed), as a
    sentence-transformers directory."""
    random_encoder(kind).save_pretrained(path)
    write_bert_tokenizer(path)
    return write_pipeline_files(path, ENCODER_COMMON["hidden_size"], pooling, normalize, max_seq_length=64)


def write_cross_encoder(path: Path, kind: str = "xlm-roberta") -> Path:
    """A random one-label sequence-classification head over a BERT or XLM-R encoder."""
    torch.manual_seed(5)
    common = dict(ENCODER_COMMON, num_hidden_layers=2, num_labels=1)
    config = (BertConfig(**common, max_position_embeddings=128, pad_token_id=0, type_vocab_size=2) if kind == "bert"
              else XLMRobertaConfig(**common, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1))
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embeddings" not in name:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    write_bert_tokenizer(path)
    return path


def qwen_like_tokenizer(ends_with_eos: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE over all 256 bytes plus a few merges ("yes", "no", " the"); Qwen's special
    tokens; ``ends_with_eos`` appends ``<|endoftext|>`` to every text (Qwen3-Embedding's tokenizer).
    Left padding, as both Qwen3 models' tokenizers."""
    alphabet = list(bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate(QWEN_SPECIAL_TOKENS + alphabet + ["".join(p) for p in QWEN_MERGES])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=QWEN_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN_SPECIAL_TOKENS])
    if ends_with_eos:
        backend.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                               special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   padding_side="left")


def tiny_qwen3(seed: int):
    config = Qwen3Config(vocab_size=280, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)          # peaked attention: every token's position matters
            else:
                param.add_(0.2 * torch.randn_like(param))    # norms off one, so a missing q/k norm shows
    return model.eval()


def write_qwen3_embedding(path: Path, prompts: dict[str, str] | None = None) -> Path:
    """As sentence-transformers saves Qwen3-Embedding: the bare Qwen3Model's weights (no ``model.``
    prefix, no lm_head, ``architectures: ["Qwen3Model"]``), lasttoken pooling, Normalize, prompts."""
    tiny_qwen3(seed=1).model.save_pretrained(path)
    qwen_like_tokenizer(ends_with_eos=True).save_pretrained(path)
    return write_pipeline_files(path, 32, "lasttoken", normalize=True, max_seq_length=128, prompts=prompts)


def write_qwen3_reranker(path: Path) -> Path:
    """Qwen3-Reranker's shape: a plain Qwen3ForCausalLM directory with its own lm_head."""
    tiny_qwen3(seed=2).save_pretrained(path)
    qwen_like_tokenizer(ends_with_eos=False).save_pretrained(path)
    return path
