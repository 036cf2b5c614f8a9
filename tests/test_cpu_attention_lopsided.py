"""The CPU attention routine on lopsided mixed batches (one long prefill beside many short queries,
as an in-step shared prefix makes them): the long query runs alone instead of padding every other
sequence to its length, and the result equals the reference."""
import pytest
import torch

from hearth_llm.kernels.attention import cpu, reference


def batch(query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    order = torch.randperm(sum(blocks_per_seq) + 1, generator=generator).tolist()
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = torch.tensor([order.pop() for _ in range(n)])
    cache_shape = (sum(blocks_per_seq) + 1, block_size, num_kv_heads, head_dim)
    return dict(query=torch.randn(sum(query_lens), num_heads, head_dim, generator=generator),
                key_cache=torch.randn(cache_shape, generator=generator),
                value_cache=torch.randn(cache_shape, generator=generator), block_tables=tables,
                context_lens=torch.tensor(context_lens), query_start_loc=torch.tensor([0, *query_lens]).cumsum(0),
                max_query_len=max(query_lens), max_context_len=max(context_lens), scale=head_dim ** -0.5)


@pytest.mark.parametrize("query_lens, context_lens", [
    ([200] + [8] * 9, [200] + [208] * 9),            # a shared 200-token prefix, computed once, and its readers
    ([3, 150, 1, 6, 170], [40, 150, 90, 6, 300]),     # two long queries among short ones, one fresh
    ([150, 120], [150, 900]),                          # only long queries
])
@pytest.mark.parametrize("sliding_window", [None, 64])
def test_lopsided_mixed_batch_equals_reference(query_lens, context_lens, sliding_window):
    inputs = batch(query_lens, context_lens)
    assert cpu._split_of_lopsided_batch(inputs["query_start_loc"], inputs["context_lens"], inputs["max_query_len"],
                                        inputs["max_context_len"]) is not None
    torch.testing.assert_close(cpu.paged_attention(**inputs, sliding_window=sliding_window),
                               reference.paged_attention(**inputs, sliding_window=sliding_window),
                               atol=1e-5, rtol=1e-5)


def test_balanced_mixed_batch_is_not_split():
    inputs = batch([20, 18, 1], [40, 30, 35])
    assert cpu._split_of_lopsided_batch(inputs["query_start_loc"], inputs["context_lens"], inputs["max_query_len"],
                                        inputs["max_context_len"]) is None
