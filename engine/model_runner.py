"""Owns the model and its paged KV cache; turns a scheduled batch into one forward pass."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import model_class_for
from .models.layers import AttentionMetadata
from .scheduler import ScheduledBatch

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(slots=True)
class ForwardOutput:
    """Logits for the rows the sampler needs: one per request whose step ends at its last token."""

    logits: torch.Tensor                          # [num_sampling_requests, vocab], float32
    sampling_rows: list[int]                      # index into the batch of each logits row
    prompt_logits: dict[int, torch.Tensor]        # batch index → [num_new_tokens, vocab] for prompt logprobs


class ModelRunner:
    def __init__(self, checkpoint, device: torch.device, dtype: torch.dtype, block_size: int,
                 kv_cache_memory: int | None):
        self.decode_graphs = None
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        model_class = model_class_for(checkpoint.config)
        self.arch = model_class.arch_from_hf_config(checkpoint.config)
        with torch.device("meta"):
            model = model_class(self.arch)
        model = model.to_empty(device=device).to(dtype)
        model.materialize_buffers(dtype)
        model.load_weights(checkpoint.state_dict)
        self.model = model.eval()
        self.num_blocks = self._num_kv_blocks(kv_cache_memory)
        cache_shape = (self.arch.num_hidden_layers, 2, self.num_blocks, block_size,
                       self.arch.num_key_value_heads, self.arch.head_dim)
        self.kv_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.arch.num_hidden_layers)]

    @property
    def bytes_per_block(self) -> int:
        arch = self.arch
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * arch.num_hidden_layers * self.block_size * arch.num_key_value_heads * arch.head_dim * element_size

    def _num_kv_blocks(self, kv_cache_memory: int | None) -> int:
        if kv_cache_memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_memory = int(free * GPU_MEMORY_UTILIZATION)
            else:
                kv_cache_memory = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = kv_cache_memory // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory} holds no KV block; one block needs {self.bytes_per_block} bytes"
            )
        return num_blocks

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture decode graphs (CUDA only); decode steps up to ``max_batch`` sequences replay them."""
        if self.device.type != "cuda":
            return
        from .cuda_graphs import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_model_len, self.block_size,
                                          self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> ForwardOutput:
        inputs = self._prepare_inputs(batch)
        meta = inputs["meta"]
        graphs = self.decode_graphs
        if graphs is not None and meta.max_query_len == 1 and graphs.supports(len(batch.requests)):
            hidden = graphs.run(inputs["input_ids"], inputs["positions"], meta.slot_mapping, meta.block_tables,
                                meta.context_lens)
        else:
            hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, meta)
        sampling_rows, last_indices, prompt_logits = [], [], {}
        start = 0
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            end = start + num_new
            reaches_end = request.num_computed_tokens + num_new == request.num_tokens
            if request.wants_prompt_logprobs and request.num_computed_tokens < request.num_prompt_tokens:
                prompt_logits[index] = self.model.compute_logits(hidden[start:end]).float()
            if reaches_end:
                sampling_rows.append(index)
                last_indices.append(end - 1)
            start = end
        index_tensor = torch.tensor(last_indices, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index_tensor)).float()
        return ForwardOutput(logits=logits, sampling_rows=sampling_rows, prompt_logits=prompt_logits)

    def _prepare_inputs(self, batch: ScheduledBatch) -> dict:
        block_size = self.block_size
        input_ids, positions, slots, context_lens, query_start_loc = [], [], [], [], [0]
        max_blocks = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = request.block_ids
            slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
            context_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            max_blocks = max(max_blocks, len(block_ids))
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in batch.requests]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables),
            context_lens=as_tensor(context_lens),
            query_start_loc=as_tensor(query_start_loc),
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(context_lens),
        )
        return {"input_ids": as_tensor(input_ids), "positions": as_tensor(positions), "meta": meta}
