"""A GGUF tensor still in llama.cpp's blocks, as the loader hands it to a model.

Each row of a ``[N, K]`` weight is ``K / block_size`` blocks of ``type_size`` bytes; the formats
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and their layouts are described and decoded in
``kernels/quant/gguf_reference.py``, bit-equal to ``gguf.quants.dequantize``.

A linear method that runs a block format takes :attr:`data` as it is (``engine/models/quant``);
the int4 CPU method takes the codes and scales of Q4_0/Q4_1 from :meth:`int4_parts`; anything
else takes :meth:`dequantized`.

>>> blocks = GGUFBlocks("Q4_1", raw_uint8_rows)       # [N, K / 32 * 20] bytes
>>> blocks.shape, blocks.dequantized(torch.bfloat16).shape
(torch.Size([N, K]), torch.Size([N, K]))
"""
from __future__ import annotations

import torch

from hearth_llm.kernels.quant.gguf_reference import BLOCK_FORMATS, GGUF_TYPES, dequantize

BLOCK_SIZE = 32  # Q4_0 .. Q8_0; the K-quants' super-blocks hold 256
BYTES_PER_BLOCK = {name: fmt.type_size for name, fmt in BLOCK_FORMATS.items()}
# Every type the GGUF loader keeps as blocks (BLOCK_FORMATS also has W4G128, AWQ/GPTQ repacked).
BLOCK_TYPES = GGUF_TYPES
# The types whose codes and scales :meth:`GGUFBlocks.int4_parts` hands to the int4 CPU method.
KEPT_TYPES = ("Q4_0", "Q4_1")


class GGUFBlocks:
    """``data``: uint8 ``[rows, num_blocks * type_size]``; ``quant_type``: a ``BLOCK_FORMATS`` name.

    ``input_order`` (int64 ``[columns]``, GPTQ act-order): the blocks hold the weight's columns in
    this order — column ``j`` of the blocks is column ``input_order[j]`` of the weight — so
    ``x @ W.T == x[:, input_order] @ blocks.T``; None for the natural order.
    """

    __slots__ = ("quant_type", "data", "_codes", "input_order")

    def __init__(self, quant_type: str, data: torch.Tensor, input_order: torch.Tensor | None = None) -> None:
        if quant_type not in BYTES_PER_BLOCK:
            raise ValueError(f"quant_type must be one of {tuple(BLOCK_FORMATS)}, got {quant_type!r}")
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % BYTES_PER_BLOCK[quant_type]:
            raise ValueError(f"{quant_type} data must be uint8 rows of whole {BYTES_PER_BLOCK[quant_type]}-byte "
                             f"blocks, got {data.dtype} {tuple(data.shape)}")
        self.quant_type = quant_type
        self.data = data
        self._codes = None
        self.input_order = input_order

    @property
    def block_size(self) -> int:
        return BLOCK_FORMATS[self.quant_type].block_size

    @property
    def num_blocks(self) -> int:
        return self.data.shape[1] // BYTES_PER_BLOCK[self.quant_type]

    @staticmethod
    def logical_columns(quant_type: str, num_bytes: int) -> int:
        """Columns of a weight whose rows are ``num_bytes`` of ``quant_type`` blocks."""
        return BLOCK_FORMATS[quant_type].num_columns(num_bytes)

    @property
    def shape(self) -> torch.Size:
        """The logical ``[rows, columns]`` shape of the weight."""
        return torch.Size((self.data.shape[0], self.num_blocks * self.block_size))

    def narrow(self, dim: int, start: int, length: int) -> "GGUFBlocks":
        """Rows of it (``dim=0``), or columns in whole blocks (``dim=1``)."""
        if dim == 0:
            return GGUFBlocks(self.quant_type, self.data.narrow(0, start, length), self.input_order)
        if self.input_order is not None and (start, length) != (0, self.shape[1]):
            raise ValueError("act-order (permuted-column) blocks cannot be split along their columns")
        if self.input_order is not None:
            return self
        block_size = self.block_size
        if dim != 1 or start % block_size or length % block_size:
            raise ValueError(f"GGUF {self.quant_type} blocks narrow along rows, or along columns by multiples "
                             f"of {block_size}")
        size = BYTES_PER_BLOCK[self.quant_type]
        return GGUFBlocks(self.quant_type, self.data.narrow(1, start // block_size * size, length // block_size * size))

    def _blocks(self) -> torch.Tensor:
        return self.data.reshape(self.data.shape[0], self.num_blocks, BYTES_PER_BLOCK[self.quant_type])

    def _float16_field(self, blocks: torch.Tensor, offset: int) -> torch.Tensor:
        return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]

    def _check_int4(self) -> None:
        if self.quant_type not in KEPT_TYPES or self.input_order is not None:
            raise ValueError(f"int4 parts exist for {KEPT_TYPES} blocks, not {self.quant_type}")

    def codes(self) -> torch.Tensor:
        """Q4_0/Q4_1: the 4-bit codes 0..15 as uint8 ``[rows, columns]`` (computed once per object)."""
        self._check_int4()
        if self._codes is None:
            # Contiguous first: the nibble ops run ~5x faster than on the strided block view.
            packed = self._blocks()[..., -16:].contiguous()
            self._codes = torch.stack((packed & 0x0F, packed >> 4), dim=-2).reshape(self.shape)
        return self._codes

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q4_0/Q4_1: ``(codes, scales, zeros)`` with ``value = (code - 8) * scale + zero`` per block
        of 32: codes uint8 ``[rows, columns]``, scales and zeros float32 ``[rows, num_blocks]``."""
        self._check_int4()
        blocks = self._blocks()
        scales = self._float16_field(blocks, 0)
        if self.quant_type == "Q4_0":
            zeros = torch.zeros_like(scales)
        else:
            zeros = self._float16_field(blocks, 2) + 8 * scales
        return self.codes(), scales.squeeze(-1), zeros.squeeze(-1)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values, bit-equal to ``gguf.quants.dequantize`` in float32, then cast
        (in the weight's own column order, also for act-order blocks)."""
        values = dequantize(self.data, self.quant_type)
        if self.input_order is not None:
            values = values[:, torch.argsort(self.input_order.to(values.device))]
        return values.to(dtype)

    def __repr__(self) -> str:
        return f"GGUFBlocks({self.quant_type}, shape={tuple(self.shape)})"
