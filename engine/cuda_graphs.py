"""CUDA graphs for decode and verification steps: one captured forward per padded row count,
replayed with the step's inputs copied into static buffers, so a step costs one launch, not hundreds.

A graph's rows are single-token queries, each with its own block table row and context length.
A decode step is one row per sequence. A speculative verification step (a sequence's last token
and its ``k`` proposals) becomes ``k + 1`` rows that share the sequence's block table, row ``j``
seeing the first ``start + j + 1`` positions: every row's keys and values are written to the cache
before attention reads them, so this is exactly the causal attention of the ``k + 1`` tokens
(:func:`as_single_token_rows`), run by the same decode kernel as a decode step.
"""
from __future__ import annotations

import numpy as np
import torch

from hearth_llm import kernels

from .models.layers import AttentionMetadata

MAX_GRAPH_ROWS = 512
# Row counts whose graphs end in the LM head and a greedy argmax too (``with_head``): batch-size-1
# decode, where the head's launch and the argmax's two are a third of a Qwen3-0.6B step's host time
# and the head's GEMV overlaps the last layer's kernels (programmatic dependent launch). One row has
# no padding, so the head computes exactly what the eager head would.
HEAD_SIZES = frozenset({1})


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first that holds ``max_rows``.

    >>> capture_sizes(5), capture_sizes(20)[-2:]      # 1 sequence verifying 4 proposals; 4 of them
    ([1, 2, 4, 8], [16, 32])
    """
    candidates = [1, 2, 4, 8] + list(range(16, max_rows + 16, 16))
    end = next(index for index, size in enumerate(candidates) if size >= max_rows)
    return candidates[:end + 1]


def graph_rows(max_batch: int, num_speculative_tokens: int) -> int:
    """Rows to capture for ``max_batch`` sequences, each verifying up to ``num_speculative_tokens``
    proposals (``1 + k`` rows each), capped at :data:`MAX_GRAPH_ROWS` (beyond: eager)."""
    return max(min(max_batch * (1 + num_speculative_tokens), MAX_GRAPH_ROWS), min(max_batch, MAX_GRAPH_ROWS))


def as_single_token_rows(table: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray):
    """A step whose sequences each compute their last few tokens, as single-token rows:
    ``(block table row of each token, context length of each token)``.

    >>> as_single_token_rows(np.array([[7, 8]]), np.array([0, 0, 0]), np.array([16, 17, 18]))[1]
    array([17, 18, 19])
    """
    return table[seq_of_token], positions + 1


class DecodeGraphs:
    """Captured forwards of single-token rows, for row counts up to ``max_rows``.

    Padded rows write nowhere (slot -1) and attend to one cached token, so they cost little and
    touch no live block. With ``with_head``, the graphs of :data:`HEAD_SIZES` rows also compute the
    logits and their greedy argmax (:meth:`head_outputs`).
    """

    def __init__(self, model, kv_caches, max_rows: int, max_model_len: int, block_size: int, device,
                 with_head: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.head_sizes = HEAD_SIZES if with_head else frozenset()  # as captured
        self.sizes = self._capture_sizes(max_rows)
        max_rows = self.sizes[-1]
        self.max_blocks = max_blocks = -(-max_model_len // block_size)
        long = dict(dtype=torch.long, device=device)
        # The per-row inputs are views of one buffer, so a step can fill them in one copy (:meth:`stage`):
        # input ids, positions, slots, context lengths, each padded to 16 entries (128-byte aligned,
        # as Triton specializes on it), then the block table rows.
        self._region = region = -(-max_rows // 16) * 16
        self.staging = torch.zeros(4 * region + max_rows * max_blocks, **long)
        self.input_ids = self.staging[:max_rows]
        self.positions = self.staging[region:region + max_rows]
        self.slot_mapping = self.staging[2 * region:2 * region + max_rows].fill_(-1)
        self.context_lens = self.staging[3 * region:3 * region + max_rows].fill_(1)
        self.block_tables = self.staging[4 * region:].view(max_rows, max_blocks)
        self.query_start_loc = torch.arange(max_rows + 1, **long)
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._head_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # size -> (logits, argmax)
        self.num_replays = 0
        self.num_replayed_rows = 0
        self._capture_all()

    def supports(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def _capture_sizes(self, max_rows: int) -> list[int]:
        return capture_sizes(max_rows)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_context_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    def _has_head(self, size: int) -> bool:
        return size in self.head_sizes

    def _forward_and_head(self, size: int) -> torch.Tensor:
        """The forward's hidden states; for a head size, its logits and greedy ids kept too."""
        hidden = self._forward(size)
        if self._has_head(size):
            logits = self.model.compute_logits(hidden)
            self._head_outputs[size] = (logits, kernels.argmax(logits))
        return hidden

    def head_outputs(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(logits, greedy token ids)`` of the last replay of ``num_rows`` rows, when its graph
        computed them (a head size, unpadded); else None. Valid until the next replay."""
        return self._head_outputs.get(num_rows) if self._has_head(num_rows) else None

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward_and_head(size)  # warm up: compiles the Triton kernels for this shape
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: other engines of the process keep running (allocating, syncing) on
                # their threads while this one captures, e.g. when it wakes from sleep or is shrunk.
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.outputs[size] = self._forward_and_head(size)
                graph.replay()  # the first replay uploads the graph: keep that out of serving
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def padded_size(self, num_rows: int) -> int:
        """The captured row count that serves ``num_rows``."""
        return next(s for s in self.sizes if s >= num_rows)

    def stage(self, token_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
              block_ids: list[list[int]]) -> None:
        """Fill the static inputs of ``len(token_ids)`` rows from host lists in one non-blocking copy
        from pinned memory (padding rows as :meth:`run` leaves them: slot -1, one cached token); then
        :meth:`replay_staged`. As in :meth:`run`, each block table row is written up to the step's
        width (a multiple of 16; beyond ``max_model_len``'s blocks cut), the rest of it left as it was."""
        num_rows, region, max_blocks = len(token_ids), self._region, self.max_blocks
        size = self.padded_size(num_rows)
        width = min(-(-max(map(len, block_ids)) // 16) * 16, max_blocks)
        pinned = self.staging.device.type == "cuda"
        host = torch.zeros(4 * region + (num_rows - 1) * max_blocks + width, dtype=torch.long, pin_memory=pinned)
        values = host.numpy()
        values[:num_rows] = token_ids
        values[region:region + num_rows] = positions
        values[2 * region:2 * region + size] = -1
        values[2 * region:2 * region + num_rows] = slots
        values[3 * region:3 * region + size] = 1
        values[3 * region:3 * region + num_rows] = context_lens
        for row, ids in enumerate(block_ids):
            start = 4 * region + row * max_blocks
            ids = ids[:width]
            values[start:start + len(ids)] = ids
        self.staging[:host.shape[0]].copy_(host, non_blocking=pinned)

    def views(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, positions, slot_mapping, block_tables, context_lens, query_start_loc, rows)``
        of the first ``num_rows`` rows, views of the static inputs (``rows``: 0 .. num_rows - 1), made
        once per row count (each slice costs the host a microsecond or two)."""
        views = self._views.get(num_rows)
        if views is None:
            views = self._views[num_rows] = (
                self.input_ids[:num_rows], self.positions[:num_rows], self.slot_mapping[:num_rows],
                self.block_tables[:num_rows], self.context_lens[:num_rows], self.query_start_loc[:num_rows + 1],
                self.query_start_loc[:num_rows])
        return views

    def replay_staged(self, num_rows: int) -> torch.Tensor:
        """Replay the graph for ``num_rows`` rows over the static inputs as they stand (:meth:`stage`)."""
        size = self.padded_size(num_rows)
        self.graphs[size].replay()
        self.num_replays += 1
        self.num_replayed_rows += num_rows
        return self.outputs[size][:num_rows]

    def run(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        """Replay the smallest captured graph that fits; returns hidden states for the real rows.

        ``block_tables`` and ``context_lens`` are per row (see :func:`as_single_token_rows`)."""
        num_rows = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_rows)
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.slot_mapping[:num_rows].copy_(slot_mapping)
        width = min(block_tables.shape[1], self.block_tables.shape[1])  # beyond: zero padding
        self.block_tables[:num_rows, :width].copy_(block_tables[:, :width])
        self.context_lens[:num_rows].copy_(context_lens)
        if num_rows < size:  # padding rows (each torch call costs the host microseconds, even on nothing)
            self.slot_mapping[num_rows:size].fill_(-1)
            self.context_lens[num_rows:size].fill_(1)
        self.graphs[size].replay()
        self.num_replays += 1
        self.num_replayed_rows += num_rows
        return self.outputs[size][:num_rows]
