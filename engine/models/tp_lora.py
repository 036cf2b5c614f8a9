"""A LoRA adapter's matrices cut to one tensor-parallel rank's slice of a linear layer.

Adapters are read and checked against the whole model (``engine/lora/adapter.py``: ``a`` ``[r,
in]``, ``b_scaled`` ``[r, rows]`` for output rows ``row_start ..`` of the whole layer); each rank
keeps, as vLLM's ``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA`` do:

* column-parallel layers (q/k/v, gate/up, replicated ones): ``a`` whole, and ``b_scaled``'s
  columns of the output rows this rank holds, at their place in the rank's weight (key/value
  heads replicated over ranks included);
* row-parallel layers (o_proj, down_proj): ``a``'s columns of this rank's input slice, and
  ``b_scaled`` whole. Each rank's update ``(x_r @ a_r.T) @ b`` joins its partial product
  before the layer's one all-reduce, which sums the shrink over the ranks:
  ``sum_r x_r a_r^T b = x a^T b``; no extra collective.

>>> rank_shards(layer, adapter.layers["layers.0.self_attn.qkv_proj"])   # this rank's pieces
"""
from __future__ import annotations

import dataclasses

import numpy as np


def rank_shards(layer, shards) -> list:
    """``shards`` (``ShardLoRA`` of the whole layer) as pieces of ``layer``'s rank slice, with
    ``row_start`` in the rank's own output rows."""
    if layer.parallel.size == 1:
        return list(shards)
    if layer.splits_input:
        width = layer.input_size_per_rank
        start = layer.parallel.rank * width
        return [dataclasses.replace(shard, a=shard.a[:, start:start + width].contiguous()) for shard in shards]
    whole_starts = np.cumsum([0] + layer.output_sizes).tolist()
    pieces = []
    for shard in shards:
        first_row, last_row = shard.row_start, shard.row_start + shard.b_scaled.shape[1]
        for block, shard_id in enumerate(layer.shard_ids):
            first_in_shard, num_rows = layer.rank_rows(shard_id)
            source = whole_starts[block] + first_in_shard   # this rank's rows of the shard, in whole-layer rows
            low, high = max(first_row, source), min(last_row, source + num_rows)
            if low >= high:
                continue
            local = layer.shard_rows(shard_id)[0] + low - source
            pieces.append(dataclasses.replace(shard, block=block, row_start=local,
                                              b_scaled=shard.b_scaled[:, low - first_row:high - first_row]))
    return pieces
