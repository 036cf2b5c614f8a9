"""CUDA graphs for an engine with LoRA: two captured sets, so base-only steps pay nothing for LoRA.

One set is captured as the plain model (the wrapped layers launch nothing when a step has no
adapter), one inside :meth:`LoRAManager.capturing` with the LoRA kernels, which read each
replay's plan from fixed buffers. A step replays the set its batch needs, chosen on the host from
the plan :meth:`LoRAManager.begin_step` just set. Costs a second capture and a second graph pool.

>>> graphs = LoRADecodeGraphs(lambda: DecodeGraphs(model, kv_caches, 256, 4096, 16, device), manager)
>>> graphs.run(input_ids, positions, slot_mapping, block_tables, context_lens)   # after begin_step
"""
from __future__ import annotations


class LoRADecodeGraphs:
    """Stands where the runner keeps its ``DecodeGraphs``: ``supports``/``run`` and the counters."""

    def __init__(self, capture, manager) -> None:
        self.manager = manager
        self.base = capture()
        with manager.capturing():
            self.with_adapters = capture()

    def supports(self, num_rows: int) -> bool:
        return self.base.supports(num_rows) and self.with_adapters.supports(num_rows)

    def run(self, *inputs):
        graphs = self.with_adapters if self.manager.has_adapters else self.base
        return graphs.run(*inputs)

    @property
    def sizes(self) -> list[int]:
        return self.base.sizes

    @property
    def graphs(self) -> dict:
        """The base set's graphs by size (what a base-only decode replays)."""
        return self.base.graphs

    @property
    def num_replays(self) -> int:
        return getattr(self.base, "num_replays", 0) + getattr(self.with_adapters, "num_replays", 0)

    @property
    def num_replayed_rows(self) -> int:
        return getattr(self.base, "num_replayed_rows", 0) + getattr(self.with_adapters, "num_replayed_rows", 0)
