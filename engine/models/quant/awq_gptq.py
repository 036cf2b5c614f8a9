"""AWQ and GPTQ 4-bit checkpoints, repacked exactly into the ``W4G128`` block format as they stream in.

Both store, per linear, int32-packed 4-bit codes, packed zero points and float16 scales per group
of 128 inputs; the value of weight ``(n, k)`` in group ``g = k // 128`` is ``s[g, n] * (q - z)``:

- AWQ (``quant_method="awq"``, ``version="gemm"``, AutoAWQ's layout): ``qweight`` int32
  ``[K, N / 8]`` packs 8 output columns per word in the order ``0 2 4 6 1 3 5 7`` (nibble ``i``
  holds column ``8 c + order[i]``), ``qzeros`` ``[K / 128, N / 8]`` likewise, ``scales``
  ``[K / 128, N]``; ``z`` is the stored zero.
- GPTQ (``quant_method="gptq"``, ``checkpoint_format="gptq"``): ``qweight``
  ``[K / 8, N]`` packs 8 consecutive inputs per word (nibble ``i`` is input ``8 r + i``),
  ``qzeros`` ``[K / 128, N / 8]`` 8 consecutive columns per word, ``scales`` ``[K / 128, N]``;
  ``z`` is the stored zero plus one (AutoGPTQ's v1 convention). ``g_idx`` ``[K]`` names each
  input's group: ``k // 128`` without act-order; with ``desc_act=True`` any assignment of exactly
  128 inputs per group, which we repack by sorting the inputs by group (stable) and keep the
  order as the blocks' ``input_order``: the layer gathers its input columns in that order before
  the kernel (as vLLM's exllama/Marlin paths shuffle for act-order).

:class:`Int4CheckpointScheme` validates ``quantization_config`` (4 bits, groups of 128, and the
layout fields above; anything else is refused by name before any weight is read), lists the
layers as ``W4G128`` weights of logical shape ``[N, K]``, and turns each layer's three tensors into
one :class:`GGUFBlocks` (``kernels/quant/gguf_reference.pack_w4g128``). :class:`W4G128LinearMethod`
loads them as the block method does (tensor-parallel cuts on 128-groups, act-order checks) and
runs them as it does on the CPU (numba or tiles); on CUDA it repacks each layer once after loading
into ``kernels/quant/w4_layout``'s :class:`W4Weight` (the same values: codes and headers split so
the GEMV reads wide coalesced words), which ``kernels/quant/triton_w4.py`` multiplies.

>>> scheme = Int4CheckpointScheme.from_config({"quant_method": "awq", "bits": 4, "group_size": 128,
...                                            "zero_point": True, "version": "gemm"})
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth_llm.engine.loader.gguf_blocks import GGUFBlocks
from hearth_llm.kernels import linear
from hearth_llm.kernels.quant import GGUFBlockWeight, w4_layout
from hearth_llm.kernels.quant.gguf_reference import pack_w4g128

from .gguf_block_method import GGUFBlockLinearMethod

W4G128 = "W4G128"
GROUP_SIZE = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column order[i]
_PARTS = ("qweight", "qzeros", "scales")
# Devices whose layers are repacked into W4Weight after loading (the CPU keeps the rows for its C
# and numba kernels); tests add "cpu" to run the repacked path in the Triton interpreter.
REPACK_DEVICE_TYPES = frozenset({"cuda"})


@dataclass(frozen=True, slots=True)
class Int4CheckpointScheme:
    """``method``: ``"awq"`` or ``"gptq"`` (see the module docstring)."""

    method: str

    @classmethod
    def from_config(cls, quant_config: dict) -> "Int4CheckpointScheme":
        method = quant_config.get("quant_method")
        bits = quant_config.get("bits", quant_config.get("w_bit"))
        group_size = quant_config.get("group_size", quant_config.get("q_group_size"))
        _expect("bits", bits, (4,))
        _expect("group_size", group_size, (GROUP_SIZE,))
        if method == "awq":
            _expect("version", str(quant_config.get("version", "gemm")).lower(), ("gemm",))
            _expect("zero_point", quant_config.get("zero_point", True), (True,))
        else:
            _expect("desc_act", quant_config.get("desc_act", False), (False, True))
            _expect("checkpoint_format", quant_config.get("checkpoint_format", "gptq"), ("gptq",))
            if quant_config.get("static_groups"):
                raise ValueError("config.json: quantization_config.static_groups=True is not supported")
        return cls(method)

    def _layers(self, shapes) -> dict[str, int]:
        """Layer prefix -> output rows, for every layer stored as ``qweight``."""
        if shapes is None:
            raise ValueError(f"{self.method.upper()} checkpoints must be safetensors (their headers name the parts)")
        return {name[:-len(".qweight")]: shapes[name[:-len("qweight")] + "scales"][0][1]
                for name in shapes if name.endswith(".qweight")}

    def weight_formats(self, shapes) -> dict[str, str]:
        return {prefix + ".weight": W4G128 for prefix in self._layers(shapes)}

    def checkpoint_shapes(self, shapes):
        """Headers as the model sees them: each layer's parts become one ``weight`` ``[N, K]``."""
        result = {}
        layers = self._layers(shapes)
        for name, (shape, file) in shapes.items():
            prefix, _, part = name.rpartition(".")
            if prefix in layers and part in _PARTS + ("g_idx",):
                if part == "scales":
                    result[prefix + ".weight"] = ((shape[1], shape[0] * GROUP_SIZE), file)
                continue
            result[name] = (shape, file)
        return result

    def weights(self, stream, shapes):
        """The stream with each layer's parts repacked into one ``GGUFBlocks`` when all have arrived."""
        layers = self._layers(shapes)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream:
            prefix, _, part = name.rpartition(".")
            if prefix not in layers or part not in _PARTS + ("g_idx",):
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[part] = tensor
            if len(parts) == len(_PARTS) + (prefix + ".g_idx" in shapes):
                del pending[prefix]
                codes_order = _input_order(prefix, parts.pop("g_idx", None))
                yield prefix + ".weight", GGUFBlocks(W4G128, self.repack(parts, codes_order), codes_order)
        if pending:
            missing = {prefix: sorted(set(_PARTS) - set(parts)) or ["g_idx"] for prefix, parts in pending.items()}
            raise ValueError(f"{self.method.upper()} checkpoint lacks parts of layers: {missing}")

    def repack(self, parts: dict[str, torch.Tensor], input_order: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 ``W4G128`` rows ``[N, K / 128 * 68]`` from one layer's ``qweight``/``qzeros``/``scales``,
        the inputs in ``input_order`` (act-order; None: as stored)."""
        scales = parts["scales"].to(torch.float16).t()                             # [N, G]
        if self.method == "awq":
            codes = unpack_int32(parts["qweight"], AWQ_ORDER).t()                    # [N, K]
            zeros = unpack_int32(parts["qzeros"], AWQ_ORDER).t()                     # [N, G]
        else:
            codes = unpack_int32(parts["qweight"].t(), tuple(range(8)))             # [N, K]
            zeros = unpack_int32(parts["qzeros"], tuple(range(8))).t() + 1           # [N, G]
        if input_order is not None:
            codes = codes.index_select(1, input_order.to(codes.device))
        return pack_w4g128(codes, scales, zeros)


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, C]`` int32 words -> ``[R, 8 C]`` codes 0..15, nibble ``i`` of word ``c`` at column ``8 c + order[i]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # checkpoints may load on CUDA
    nibbles = (packed[:, :, None] >> shifts) & 0xF                                # [R, C, 8]
    columns = torch.empty_like(nibbles)
    columns[:, :, list(order)] = nibbles
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def _input_order(prefix: str, g_idx: torch.Tensor | None) -> torch.Tensor | None:
    """None when ``g_idx`` is ``k // 128`` (or absent); else the inputs sorted by group (stable),
    each group of exactly 128 inputs (ValueError naming the layer otherwise)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).cpu()
    if torch.equal(g_idx, torch.arange(g_idx.numel()) // GROUP_SIZE):
        return None
    num_groups = g_idx.numel() // GROUP_SIZE
    if g_idx.numel() % GROUP_SIZE or g_idx.min() < 0 or g_idx.max() >= num_groups or \
            not torch.bincount(g_idx, minlength=num_groups).eq(GROUP_SIZE).all():
        raise ValueError(f"{prefix}.g_idx must give each of its {num_groups} groups exactly {GROUP_SIZE} inputs")
    return torch.argsort(g_idx, stable=True)


def _expect(field: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"config.json: quantization_config.{field}={value!r} is not supported; supported: "
                         f"{list(allowed)}")


class W4G128LinearMethod(GGUFBlockLinearMethod):
    """AWQ/GPTQ layers (one ``W4G128`` run): loaded as :class:`GGUFBlockLinearMethod` loads blocks;
    on CUDA (``REPACK_DEVICE_TYPES``) repacked by :func:`w4_layout.from_rows` after loading (buffers
    ``w4_codes`` and ``w4_headers``: the rows' bytes, rearranged) and multiplied through
    ``kernels.linear`` as a :class:`w4_layout.W4Weight`."""

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        if self.w4_weight(layer) is not None:  # repacked already
            return
        (run,) = layer.gguf_runs
        rows = getattr(layer, run.name)
        if rows.device.type not in REPACK_DEVICE_TYPES:
            return
        weight = w4_layout.from_rows(rows)
        delattr(layer, run.name)
        layer.register_buffer("w4_codes", weight.codes)
        layer.register_buffer("w4_headers", weight.headers)

    @staticmethod
    def w4_weight(layer) -> w4_layout.W4Weight | None:
        """The repacked weight (made per call from the buffers), or None where the rows stay."""
        codes = getattr(layer, "w4_codes", None)
        return None if codes is None else w4_layout.W4Weight(codes, layer.w4_headers)

    def block_weights(self, layer) -> list[GGUFBlockWeight]:
        weight = self.w4_weight(layer)
        if weight is None:
            return super().block_weights(layer)
        return [GGUFBlockWeight(W4G128, w4_layout.to_rows(weight))]  # a copy: rows for the block kernels

    def apply(self, layer, x, bias):
        weight = self.w4_weight(layer)
        if weight is None:
            return super().apply(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        order = getattr(layer, "gguf_input_order", None)
        if order is not None:  # act-order: feed the columns in the order they were stored
            flat = flat.index_select(-1, order)
        out = linear(flat, weight, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def forward_routine(self, layer):
        return None if self.w4_weight(layer) is not None else super().forward_routine(layer)

    # Batch-size-1 decode (engine/models/fused_decode.py): RMSNorm / SwiGLU inside the one-row kernel.
    def _fused_kernels(self, layer, x):
        """``triton_w4`` and the layer's weight where a fused one-row kernel may replace it: a
        repacked weight, no bias, no act-order gather, one process, one CUDA row; else None."""
        weight = self.w4_weight(layer)
        if (weight is None or layer.bias is not None or getattr(layer, "gguf_input_order", None) is not None
                or layer.parallel.size != 1 or x.dim() != 2 or x.shape[0] != 1 or x.device.type != "cuda"):
            return None
        try:
            from hearth_llm.kernels.quant import triton_w4
        except ImportError:
            return None
        return (triton_w4, weight) if triton_w4.FUSED_ROW else None

    def fused_rms_norm_linear(self, layer, x, residual, norm_weight, eps):
        """``(layer(RMSNorm(x + residual)), x + residual)`` in one launch, or None."""
        found = self._fused_kernels(layer, x)
        return None if found is None else found[0].rms_norm_linear(x, residual, norm_weight, eps, found[1])

    def fused_silu_and_mul_linear(self, layer, x):
        """``layer(silu(x[:, :K]) * x[:, K:])`` in one launch, or None."""
        found = self._fused_kernels(layer, x)
        return None if found is None else found[0].silu_and_mul_linear(x, found[1])

    def fused_rms_norm_linear_silu_and_mul(self, layer, x, residual, norm_weight, eps):
        """``(silu_and_mul(layer(RMSNorm(x + residual))), x + residual)`` for a stacked gate/up layer
        in one launch, or None."""
        found = self._fused_kernels(layer, x)
        if found is None or not found[0].SWIGLU_EPILOGUE:
            return None
        return found[0].rms_norm_linear_silu_and_mul(x, residual, norm_weight, eps, found[1])

    def resident_bytes(self, layer) -> int:
        weight = self.w4_weight(layer)
        if weight is None:
            return super().resident_bytes(layer)
        order = getattr(layer, "gguf_input_order", None)
        extra = 0 if order is None else order.numel() * order.element_size()
        return sum(t.numel() * t.element_size() for t in (weight.codes, weight.headers)) + extra
