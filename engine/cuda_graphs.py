"""CUDA graphs for decode steps: one captured forward per padded batch size, replayed with the
step's inputs copied into static buffers, so a decode step costs one launch, not hundreds."""
from __future__ import annotations

import torch

from .models.layers import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    return sizes


class DecodeGraphs:
    """Captured decode forwards for batch sizes up to ``max_batch``.

    Padded rows write nowhere (slot -1) and attend to one cached token, so they cost little and
    touch no live block.
    """

    def __init__(self, model, kv_caches, max_batch: int, max_model_len: int, block_size: int, device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.full((max_batch,), -1, **long)
        self.block_tables = torch.zeros(max_batch, max_blocks, **long)
        self.context_lens = torch.ones(max_batch, **long)
        self.query_start_loc = torch.arange(max_batch + 1, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def supports(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_context_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm up: compiles the Triton kernels for this shape
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: other engines of the process keep running (allocating, syncing) on
                # their threads while this one captures, e.g. when it wakes from sleep or is shrunk.
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    self.outputs[size] = self._forward(size)
                graph.replay()  # the first replay uploads the graph: keep that out of serving
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        """Replay the smallest captured graph that fits; returns hidden states for the real rows."""
        num_seqs = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        width = min(block_tables.shape[1], self.block_tables.shape[1])  # beyond: zero padding
        self.block_tables[:num_seqs, :width].copy_(block_tables[:, :width])
        self.context_lens[:num_seqs].copy_(context_lens)
        self.context_lens[num_seqs:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
