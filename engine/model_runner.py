"""Owns the model and its paged KV cache; turns a scheduled batch into one forward pass."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from hearth_llm import kernels
from hearth_llm.kernels.attention import flash_prefill

from .batch import ForwardOutput, ScheduledBatch
from .cuda_graphs import as_single_token_rows
from .loader.model_loader import load_model
from .lora.graphs import LoRADecodeGraphs
from .lora.manager import LoRAManager
from .memory.kv_cache import new_kv_cache
from .models.layers import AttentionMetadata
from .sampler import _blocks_early_stop, _is_plain_greedy

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.9
# Decode steps of up to this many sequences build their inputs in plain Python (_prepare_few_decodes):
# on a few rows the general builder's numpy calls cost more than they save (batch-size-1 decode).
MAX_FEW_DECODE_SEQS = 8


class ModelRunner:
    # Verification steps of up to 1 + this many tokens per sequence replay CUDA graphs too; the
    # engine sets it (speculative decoding) before the graphs are captured.
    num_speculative_tokens = 0

    def __init__(self, checkpoint, device: torch.device, dtype: torch.dtype, block_size: int,
                 kv_cache_memory: int | None, lora_config=None, max_num_batched_tokens: int = 2048,
                 parallel=None, kv_cache_dtype: torch.dtype | None = None):
        self.decode_graphs = None
        self.device = device
        self.dtype = dtype
        # What the paged cache stores: the model dtype, or FP8 e4m3 (EngineConfig.kv_cache_dtype).
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        # Config and weight names/shapes checked before anything is read; weights streamed in.
        # ``parallel`` (a TensorParallel): this rank's slice only, KV heads included.
        self.model, self.arch = load_model(checkpoint, device, dtype, parallel=parallel)
        self.is_single_process = parallel is None or parallel.size == 1
        self.num_kv_heads = _kv_heads_per_rank(self.arch.num_key_value_heads, parallel)
        # LoRA wraps the loaded layers' methods (before CUDA graphs are captured, so they include it).
        self.lora = None if lora_config is None else LoRAManager(self.model, lora_config, device,
                                                                 max(max_num_batched_tokens, 512))
        self.num_blocks = self._num_kv_blocks(kv_cache_memory)
        cache_shape = (self.arch.num_hidden_layers, 2, self.num_blocks, block_size,
                       self.num_kv_heads, self.arch.head_dim)
        self.kv_cache = new_kv_cache(cache_shape, self.kv_cache_dtype, device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.arch.num_hidden_layers)]
        self.has_flash_prefill = flash_prefill.is_usable(device, dtype, self.kv_cache_dtype)

    @property
    def bytes_per_block(self) -> int:
        arch = self.arch
        element_size = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * arch.num_hidden_layers * self.block_size * self.num_kv_heads * arch.head_dim * element_size

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
        """Capture decode graphs (CUDA only); decode steps up to ``max_batch`` sequences replay them,
        and so do verification steps of ``max_batch`` sequences with ``num_speculative_tokens`` each."""
        if self.device.type != "cuda":
            return
        from .cuda_graphs import DecodeGraphs, graph_rows

        max_rows = graph_rows(max_batch, self.num_speculative_tokens)

        # The LM head and argmax join the one-row graph where nothing else wraps them (no LoRA, one process).
        with_head = self.lora is None and self.is_single_process

        def capture():
            return DecodeGraphs(self.model, self.kv_caches, max_rows, max_model_len, self.block_size, self.device,
                                with_head=with_head)

        # With LoRA, a second set holds the LoRA kernels; base-only steps replay the plain one.
        self.decode_graphs = capture() if self.lora is None else LoRADecodeGraphs(capture, self.lora)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, pending_token_ids: torch.Tensor | None = None) -> ForwardOutput:
        """One forward pass; waits for nothing on the device, so the host may run ahead of it.

        ``pending_token_ids`` are the ids sampled by the step in flight (still on the device): a
        request with a pending token is fed its ``pending_row`` of them.
        """
        inputs = self._prepare_inputs(batch)
        meta = inputs.meta
        if self.lora is not None:
            self.lora.begin_step([request.lora for request in batch.requests], batch.num_new_tokens)
        if inputs.is_staged and inputs.num_pending:  # the pending rows come first, in the in-flight step's order
            inputs.input_ids[:inputs.num_pending].copy_(pending_token_ids[:inputs.num_pending])
        elif inputs.num_pending:
            inputs.input_ids[inputs.pending_positions] = pending_token_ids[inputs.pending_rows]
        graphs = self.decode_graphs
        head = None  # (logits, greedy ids) when the graph computed them
        # Graphs replay single-token rows: a decode step's, or a verification step's as rows (see cuda_graphs).
        if inputs.is_staged:  # the inputs are in the graphs' static buffers already
            hidden = graphs.replay_staged(inputs.input_ids.shape[0])
            head = graphs.head_outputs(hidden.shape[0])
        elif graphs is not None and inputs.row_tables is not None and graphs.supports(inputs.input_ids.shape[0]):
            hidden = graphs.run(inputs.input_ids, inputs.positions, meta.slot_mapping, inputs.row_tables,
                                inputs.row_context_lens)
            if self.lora is None:
                head = graphs.head_outputs(hidden.shape[0])
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        prompt_logits = {}
        for index in inputs.prompt_logprob_rows:
            start, end = inputs.query_bounds[index], inputs.query_bounds[index + 1]
            prompt_logits[index] = self.model.compute_logits(hidden[start:end]).float()
        # In the model's dtype: the sampler widens them to float32 unless every row is plain greedy.
        # Single-token rows (decode, verification) are all logits rows, in order: nothing to gather.
        is_every_row = inputs.row_tables is not None and inputs.logits_indices.shape[0] == hidden.shape[0]
        if head is not None and is_every_row:
            logits, greedy_token_ids = head
        else:
            rows = hidden if is_every_row else hidden.index_select(0, inputs.logits_indices)
            verified = self._greedy_verify_logits(batch, inputs, rows)
            logits, greedy_token_ids = verified if verified is not None else (self.model.compute_logits(rows), None)
        if self.lora is not None:
            self.lora.end_step()
        return ForwardOutput(logits=logits, sampling_rows=inputs.sampling_rows, prompt_logits=prompt_logits,
                             greedy_token_ids=greedy_token_ids)

    def _greedy_verify_logits(self, batch: ScheduledBatch, inputs: "StepInputs", rows: torch.Tensor):
        """A CPU verification step of one plain-greedy request: the logits head runs on its rows a
        few at a time where it splits them itself (``_verify_head_rows``) and stops at the first row
        whose argmax rejects its proposal; the rows after it are never drawn from (their logits are
        zeros, their ids 0). Returns ``(logits, greedy ids)`` (the sampler takes the ids as the
        draws), or None where this does not apply (then the head runs on every row, the sampler draws)."""
        chunk = _verify_head_rows(self.model, rows)
        if (chunk is None or len(batch.requests) != 1 or inputs.sampling_rows != [0] or inputs.prompt_logprob_rows
                or self.lora is not None):
            return None
        proposals = batch.proposals_of(0)
        request = batch.requests[0]
        if not proposals or rows.shape[0] != 1 + len(proposals) or not _is_plain_greedy(request) or _blocks_early_stop(request):
            return None
        parts, token_ids = [], []
        while len(token_ids) < rows.shape[0]:
            part = self.model.compute_logits(rows[len(token_ids):len(token_ids) + chunk])
            parts.append(part)
            # numpy's argmax: the first maximum, NaN first, as kernels.argmax; ~10x faster than torch's here
            drawn = part.numpy().argmax(axis=-1).tolist() if part.dtype == torch.float32 else kernels.argmax(part).tolist()
            token_ids += drawn
            if any(token != proposal for token, proposal in zip(token_ids, proposals)):
                break  # a rejected proposal: the rows after it are not drawn from
        num_skipped = rows.shape[0] - len(token_ids)
        if num_skipped:  # never read (the sampler takes the ids)
            parts.append(parts[0].new_zeros(num_skipped, parts[0].shape[-1]))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        return logits, torch.tensor(token_ids + [0] * num_skipped, dtype=torch.long)

    def _prepare_inputs(self, batch: ScheduledBatch) -> "StepInputs":
        """Build every index the step needs in one host array, copied to the device in one
        non-blocking transfer from pinned memory."""
        if len(batch.requests) <= MAX_FEW_DECODE_SEQS:
            inputs = self._prepare_few_decodes(batch)
            if inputs is not None:
                return inputs
        block_size = self.block_size
        requests, num_new_tokens = batch.requests, batch.num_new_tokens
        num_seqs = len(requests)
        token_ids, tables = [], []
        starts, context_lens, seq_lens, sampling_rows, logits_indices = [], [], [], [], []
        prompt_logprob_rows, pending_positions, pending_rows = [], [], []
        num_tokens = 0
        is_single_token_rows = self.decode_graphs is not None  # every request decodes or verifies
        for index, (request, num_new) in enumerate(zip(requests, num_new_tokens)):
            start = request.num_computed_tokens
            end = start + num_new
            num_known = request.num_tokens
            proposals = batch.proposals_of(index)
            if proposals:  # its last token, then the proposals to verify: a logits row for each
                token_ids += request.token_ids[start:num_known]
                token_ids += proposals
            elif end > num_known:  # the last token is pending: the device fills it in
                token_ids += request.token_ids[start:num_known]
                token_ids.append(0)
                pending_positions.append(num_tokens + num_new - 1)
                pending_rows.append(request.pending_row)
            else:
                token_ids += request.token_ids[start:end]
            num_tokens += num_new
            starts.append(start)
            context_lens.append(end)
            seq_lens.append(num_known + request.num_pending_tokens + len(proposals))
            tables.append(request.block_ids)
            if proposals or end == num_known + request.num_pending_tokens:
                sampling_rows.append(index)
                logits_indices.extend(range(num_tokens - 1 - len(proposals), num_tokens))
            else:
                is_single_token_rows = False
            is_single_token_rows = is_single_token_rows and num_new == 1 + len(proposals)
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens:
                prompt_logprob_rows.append(index)
        num_new = np.array(num_new_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        positions = np.repeat(np.array(starts, dtype=np.int64) - query_start_loc[:-1], num_new) + np.arange(num_tokens)
        table = _block_table(tables)
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
        arrays = [token_ids, positions, slots, context_lens, query_start_loc, logits_indices,
                  pending_positions, pending_rows, table.reshape(-1), seq_lens]
        is_verify = is_single_token_rows and num_tokens > num_seqs
        if is_verify:  # the graphs' metadata: a block table row and a context length per token
            row_table, row_context_lens = as_single_token_rows(table, seq_of_token, positions)
            arrays += [row_table.reshape(-1), row_context_lens]
        on_device = self._copy_to_device(arrays)
        meta = AttentionMetadata(
            slot_mapping=on_device[2],
            block_tables=on_device[8].view(table.shape),
            context_lens=on_device[3],
            query_start_loc=on_device[4],
            max_query_len=max(num_new_tokens),
            max_context_len=max(context_lens),
            seq_lens=on_device[9],
        )
        # Long prefills on FlashAttention-2 (kernels/attention/flash_prefill.py); decode steps skip the plan.
        if self.has_flash_prefill and meta.max_query_len >= flash_prefill.FLASH_MIN_QUERY_LEN:
            meta.flash_prefill = flash_prefill.plan_flash_prefill(num_new_tokens, context_lens, table, block_size,
                                                                  self._copy_to_device)
        row_tables = row_context_lens = None
        if is_verify:
            row_tables, row_context_lens = on_device[10].view(num_tokens, table.shape[1]), on_device[11]
        elif is_single_token_rows:  # a decode step: one row per sequence already
            row_tables, row_context_lens = meta.block_tables, meta.context_lens
        return StepInputs(input_ids=on_device[0], positions=on_device[1], meta=meta, logits_indices=on_device[5],
                          sampling_rows=sampling_rows, num_pending=len(pending_rows),
                          pending_positions=on_device[6], pending_rows=on_device[7],
                          prompt_logprob_rows=prompt_logprob_rows,
                          query_bounds=query_start_loc.tolist() if prompt_logprob_rows else [],
                          row_tables=row_tables, row_context_lens=row_context_lens)

    def _prepare_few_decodes(self, batch: ScheduledBatch) -> "StepInputs | None":
        """:meth:`_prepare_inputs`' arrays, in the same order and values, for a step in which every
        request computes one token, its last (known or pending), and samples it: no proposals, no
        prompt logprobs. Built with Python lists (a handful of rows); None for any other step."""
        block_size = self.block_size
        token_ids, positions, slots, context_lens, seq_lens, tables = [], [], [], [], [], []
        pending_positions, pending_rows = [], []
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start, num_known = request.num_computed_tokens, request.num_tokens
            if (num_new != 1 or start + 1 != num_known + request.num_pending_tokens or batch.proposals_of(index)
                    or (request.wants_prompt_logprobs and start < request.num_prompt_tokens)):
                return None
            if start < num_known:
                token_ids.append(request.token_ids[start])
            else:  # pending: the device fills it in
                token_ids.append(0)
                pending_positions.append(index)
                pending_rows.append(request.pending_row)
            block_ids = request.block_ids
            positions.append(start)
            slots.append(block_ids[start // block_size] * block_size + start % block_size)
            context_lens.append(start + 1)
            seq_lens.append(num_known + request.num_pending_tokens)
            tables.append(block_ids)
        num_seqs = len(tables)
        graphs = self.decode_graphs
        if (self.lora is None and graphs is not None and graphs.supports(num_seqs)
                and pending_positions == pending_rows == list(range(len(pending_rows)))):
            return self._staged_decodes(graphs, token_ids, positions, slots, context_lens, tables, len(pending_rows))
        width = -(-max(map(len, tables)) // 16) * 16  # as _block_table pads it
        flat_table = []
        for block_ids in tables:
            flat_table += block_ids
            flat_table += [0] * (width - len(block_ids))
        rows = list(range(num_seqs))
        on_device = self._copy_to_device([token_ids, positions, slots, context_lens, list(range(num_seqs + 1)), rows,
                                          pending_positions, pending_rows, flat_table, seq_lens])
        meta = AttentionMetadata(
            slot_mapping=on_device[2],
            block_tables=on_device[8].view(num_seqs, width),
            context_lens=on_device[3],
            query_start_loc=on_device[4],
            max_query_len=1,  # (so never a FlashAttention prefill)
            max_context_len=max(context_lens),
            seq_lens=on_device[9],
        )
        is_single_token_rows = self.decode_graphs is not None
        return StepInputs(input_ids=on_device[0], positions=on_device[1], meta=meta, logits_indices=on_device[5],
                          sampling_rows=rows, num_pending=len(pending_rows),
                          pending_positions=on_device[6], pending_rows=on_device[7],
                          prompt_logprob_rows=[], query_bounds=[],
                          row_tables=meta.block_tables if is_single_token_rows else None,
                          row_context_lens=meta.context_lens if is_single_token_rows else None)

    @staticmethod
    def _staged_decodes(graphs, token_ids, positions, slots, context_lens, tables, num_pending) -> "StepInputs":
        """A few-decodes step whose inputs go straight into the decode graphs' static buffers (one
        copy, :meth:`DecodeGraphs.stage`), its pending rows first and in the in-flight step's order
        (one copy of their ids, in :meth:`run`). The graphs read only what they stage."""
        graphs.stage(token_ids, positions, slots, context_lens, tables)
        input_ids, positions, slot_mapping, block_tables, context_lens_on_device, query_start_loc, rows = \
            graphs.views(len(token_ids))
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 context_lens=context_lens_on_device, query_start_loc=query_start_loc,
                                 max_query_len=1, max_context_len=max(context_lens))
        pending = graphs.views(num_pending)[6] if num_pending else rows[:0]
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta,
                          logits_indices=rows, sampling_rows=list(range(len(token_ids))), num_pending=num_pending,
                          pending_positions=pending, pending_rows=pending,
                          prompt_logprob_rows=[], query_bounds=[], row_tables=meta.block_tables,
                          row_context_lens=meta.context_lens, is_staged=True)

    def _copy_to_device(self, arrays: list) -> list[torch.Tensor]:
        """Int64 copies of ``arrays`` on the device, from one pinned host buffer in one non-blocking
        transfer. Each starts 128-byte aligned: Triton specializes kernels on pointer alignment, so
        unaligned ones would compile new kernel variants mid-run."""
        sizes = [len(values) for values in arrays]
        offsets = np.cumsum([0] + [-(-size // 16) * 16 for size in sizes]).tolist()
        host = torch.empty(offsets[-1], dtype=torch.long, pin_memory=self.device.type == "cuda")
        buffer = host.numpy()
        for offset, size, values in zip(offsets, sizes, arrays):
            buffer[offset:offset + size] = values
        device = host.to(self.device, non_blocking=True)
        return [device[offset:offset + size] for offset, size in zip(offsets, sizes)]


def _verify_head_rows(model, rows: torch.Tensor) -> int | None:
    """How many rows at a time a CPU verification step's logits head runs (see
    ``ModelRunner._greedy_verify_logits``), or None: not on this path. A GGUF block head
    (``CpuBlockLogitsHead``) on its float32 GEMV computes steps of 3 to ``gguf_cpu_native.MAX_ROWS``
    rows two at a time, each pass reading the whole head (the bundled SmolLM2's tied Q8_0 head, AVX-512
    EPYC, 1 thread, CPU ms: 1.9 / 3.3 / 8.8 for 1 / 2 / 5 rows); in pairs here its logits are the
    same, and the passes after a rejected proposal are saved. Heads that run all rows in one pass
    (a bf16 block head, dense heads) run them at once, as before; the greedy ids still come from
    here (numpy's argmax: 18 µs for 5 vocabulary rows of 49152 against the sampler's 49, 11 against
    129 for 3)."""
    from hearth_llm.kernels.quant import gguf_cpu_native

    from .models.cpu_weights import CpuBlockLogitsHead

    if VERIFY_HEAD_ROWS is None or rows.device.type != "cpu":
        return None
    head = getattr(model, "lm_head", None)
    if (type(head) is CpuBlockLogitsHead and head.routine is not None
            and not (head.bf16_gemv is not None and rows.dtype == torch.bfloat16)
            and 2 < rows.shape[0] <= gguf_cpu_native.MAX_ROWS):
        return VERIFY_HEAD_ROWS
    return rows.shape[0]


# Rows a CPU verification step's block head runs at a time (CpuBlockLogitsHead's own pairs); None: off
# (every verified row through the head at once, as before; for A/B runs).
VERIFY_HEAD_ROWS = 2


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    """Each sequence's block ids as a row, zero-padded to a width that is a multiple of 16, so the
    row stride never changes the kernels' specialization (a new variant compiled mid-run)."""
    num_blocks = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    width = -(-int(num_blocks.max()) // 16) * 16
    table = np.zeros((len(block_ids), width), dtype=np.int64)
    table[np.arange(width)[None, :] < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), dtype=np.int64, count=int(num_blocks.sum()))
    return table


@dataclass(slots=True)
class StepInputs:
    """A step's model inputs, on the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor      # flat index of each logits row: a sampling request's last token
                                      # (its last 1 + len(proposals) tokens when it verifies proposals)
    sampling_rows: list[int]
    num_pending: int
    pending_positions: torch.Tensor   # where in input_ids the pending tokens go
    pending_rows: torch.Tensor        # and which rows of the in-flight step's sampled ids they are
    prompt_logprob_rows: list[int]
    query_bounds: list[int]
    # With CUDA graphs, a step of decoding or verifying requests only: its tokens as single-token
    # rows (each token's block table row and context length); else None.
    row_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None
    # The inputs are views of the decode graphs' static buffers, filled already (_staged_decodes).
    is_staged: bool = False


def _kv_heads_per_rank(num_kv_heads: int, parallel) -> int:
    """Key/value heads in this rank's cache: split evenly, or one copy when fewer than the ranks."""
    size = 1 if parallel is None else parallel.size
    return max(1, num_kv_heads // size)
