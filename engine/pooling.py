"""Pooling: a decoder model run over whole sequences for their hidden states instead of a sampled
token — the path of decoder embedding models (Qwen3-Embedding: last-token pooling) and of
LLM-as-reranker models (Qwen3-Reranker: the "yes" and "no" logits at the last position).

It runs the LLM engine's own model code (:class:`~.models.decoder.DecoderModel`, whose ``forward``
returns the final hidden states after the final norm) with no scheduler and no KV cache kept:
every batch is one full prefill of unpadded sequences, and the layers share one scratch key/value
buffer sized for that batch. A layer writes its keys and values and reads them back before the
next layer overwrites them, so one layer's worth of KV serves the whole model.

>>> pooler = DecoderPooler.from_pretrained("/models/Qwen3-Embedding-0.6B", torch.device("cpu"), torch.float32)
>>> hidden, bounds = pooler.hidden_states([[9707, 1879, 151643], [9707, 151643]])
>>> hidden.shape, bounds                       # flat rows of both sequences, after the final norm
(torch.Size([5, 1024]), [0, 3, 5])
>>> pooler.last_hidden_states([[9707, 1879, 151643]]).shape
torch.Size([1, 1024])
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .loader import load_checkpoint
from .loader.model_loader import load_model
from .models.arch import ArchConfig
from .models.attention import AttentionMetadata
from .models.decoder import DecoderModel

# Block size of the scratch KV buffer: small enough that a short text wastes few rows, large enough
# that the attention kernels gather few blocks.
SCRATCH_BLOCK_SIZE = 16


class DecoderPooler:
    """Final hidden states (and, when the model keeps its LM head, last-position logits) of whole
    token sequences, batched without padding; thread-safe (each call has its own scratch buffer).

    Build it with :meth:`from_pretrained`, or around a loaded ``(model, arch)`` pair.
    """

    def __init__(self, model: nn.Module, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 has_logits: bool = True, tokenizer=None) -> None:
        self.model, self.arch, self.device, self.dtype = model, arch, device, dtype
        self.has_logits = has_logits
        self.tokenizer = tokenizer      # the checkpoint's, when loaded by from_pretrained

    @classmethod
    def from_pretrained(cls, path, device: torch.device, dtype: torch.dtype, with_logits: bool = False):
        """Load the decoder at ``path`` (an HF directory) with the engine's loader.

        Without ``with_logits`` the LM head is neither loaded nor kept: embedding checkpoints saved
        from the bare model (``Qwen3Model``: no ``model.`` prefix, no ``lm_head``) load as they are.
        """
        checkpoint = load_checkpoint(str(path), dtype, progress=False)
        checkpoint.config.architectures = causal_lm_architectures(checkpoint.config)
        if not with_logits:
            checkpoint.config.tie_word_embeddings = True     # the head ties to the embedding: nothing to load
        model, arch = load_model(checkpoint, device, dtype)
        if not with_logits:
            model.lm_head = nn.Identity()                    # drop the head's packed copy; never called here
        return cls(model, arch, device, dtype, has_logits=with_logits, tokenizer=checkpoint.tokenizer)

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """``(hidden [total tokens, hidden_size], bounds)``: sequence ``i``'s rows are
        ``hidden[bounds[i]:bounds[i + 1]]``, each the state after the final norm."""
        _check_token_ids(token_ids, self.arch.max_position_embeddings)
        input_ids, positions, meta, bounds = self._inputs(token_ids)
        key_cache, value_cache = self._scratch_kv(int(meta.block_tables.numel()))
        shared = [(key_cache, value_cache)] * self.arch.num_hidden_layers
        return self.model(input_ids, positions, shared, meta), bounds

    def last_hidden_states(self, token_ids: list[list[int]]) -> torch.Tensor:
        """The final hidden state of each sequence's last token, ``[len(token_ids), hidden_size]``
        (last-token pooling: in a causal model only the last token has read the whole text)."""
        hidden, bounds = self.hidden_states(token_ids)
        return hidden[torch.tensor(bounds[1:], device=hidden.device) - 1]

    @torch.inference_mode()
    def last_logits(self, token_ids: list[list[int]], vocab_ids: list[int] | None = None) -> torch.Tensor:
        """Logits at each sequence's last position, ``[len(token_ids), vocab]``, or only the
        columns ``vocab_ids`` (an LLM reranker's "yes"/"no"), float32."""
        if not self.has_logits:
            raise ValueError("this pooler was loaded without its LM head (with_logits=False)")
        last = self.last_hidden_states(token_ids)
        if vocab_ids is not None:
            return self._logits_of(last, vocab_ids)
        return self.model.compute_logits(last).float()

    def _logits_of(self, hidden: torch.Tensor, vocab_ids: list[int]) -> torch.Tensor:
        """Only the asked columns of the LM head (two rows of a 150k-row matrix), with the model's
        logit scale and soft cap applied as ``compute_logits`` does."""
        head = self.model.lm_head
        weight = getattr(head, "weight", None)
        is_plain = type(self.model).compute_logits is DecoderModel.compute_logits
        if weight is None or getattr(head, "bias", None) is not None or not is_plain:
            return self.model.compute_logits(hidden).float()[:, vocab_ids]
        rows = weight[torch.tensor(vocab_ids, device=weight.device)]
        logits = hidden.to(rows.dtype) @ rows.T
        if self.arch.logits_multiplier is not None:
            logits = logits * self.arch.logits_multiplier
        if self.arch.final_logit_softcap is not None:
            cap = self.arch.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _inputs(self, token_ids: list[list[int]]):
        """Flat ids and positions of every sequence, and attention metadata of a fresh prefill
        whose blocks are laid out one sequence after another."""
        lengths = np.array([len(ids) for ids in token_ids], dtype=np.int64)
        bounds = np.zeros(len(token_ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        num_blocks = -(-lengths // SCRATCH_BLOCK_SIZE)
        width = int(num_blocks.max())
        first_block = np.concatenate([[0], np.cumsum(num_blocks)[:-1]])
        table = first_block[:, None] + np.arange(width)[None, :]
        table = np.where(np.arange(width)[None, :] < num_blocks[:, None], table, 0)
        positions = np.arange(int(bounds[-1])) - np.repeat(bounds[:-1], lengths)
        sequence = np.repeat(np.arange(len(token_ids)), lengths)
        slots = first_block[sequence] * SCRATCH_BLOCK_SIZE + positions
        device = self.device

        def on_device(values) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)

        context_lens = on_device(lengths)
        meta = AttentionMetadata(slot_mapping=on_device(slots), block_tables=on_device(table),
                                 context_lens=context_lens, query_start_loc=on_device(bounds),
                                 max_query_len=int(lengths.max()), max_context_len=int(lengths.max()),
                                 seq_lens=context_lens)
        flat_ids = on_device([token for ids in token_ids for token in ids])
        return flat_ids, on_device(positions), meta, bounds.tolist()

    def _scratch_kv(self, num_table_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        arch = self.arch
        num_blocks = max(num_table_entries, 1)
        shape = (num_blocks, SCRATCH_BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))


def check_poolable(config) -> None:
    """``ValueError`` naming what the engine cannot run in this HF config (architecture, a config
    field), before any weight is read.

    >>> check_poolable(AutoConfig.from_pretrained("/models/Qwen3-Embedding-0.6B"))     # passes
    """
    from .models import model_class_for

    config.architectures = causal_lm_architectures(config)
    model_class_for(config).arch_from_hf_config(config)


def causal_lm_architectures(config) -> list[str]:
    """The config's architectures, with a bare model's class (``Qwen3Model``, as sentence-transformers
    saves an embedding model) mapped to the causal LM the engine registers for its model_type."""
    from .models.registry import MODEL_CLASSES, MODEL_TYPES

    declared = list(config.architectures or [])
    if any(name in MODEL_CLASSES for name in declared):
        return declared
    by_type = MODEL_TYPES.get(getattr(config, "model_type", None))
    if by_type is not None and all(name.endswith("Model") for name in declared):
        return [by_type]
    return declared      # model_class_for names what is unsupported


def _check_token_ids(token_ids: list[list[int]], max_positions: int) -> None:
    if not token_ids:
        raise ValueError("token_ids must hold at least one sequence")
    for index, ids in enumerate(token_ids):
        if not ids:
            raise ValueError(f"token_ids[{index}] is empty; every sequence needs at least one token")
        if len(ids) > max_positions:
            raise ValueError(f"token_ids[{index}] has {len(ids)} tokens, more than the model's "
                             f"max_position_embeddings={max_positions}")
