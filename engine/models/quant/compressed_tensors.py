"""FP8 checkpoints written by llm-compressor (``quantization_config.quant_method="compressed-tensors"``),
loaded as stored.

What runs: ``format="float-quantized"``, one config group targeting ``Linear`` with
``weights = {num_bits: 8, type: "float", strategy: "channel" | "tensor", symmetric: true,
dynamic: false}`` and ``input_activations = {num_bits: 8, type: "float", strategy: "token",
dynamic: true}`` (FP8 W8A8 dynamic, the common ``FP8_DYNAMIC`` scheme). Each quantized linear
stores ``weight`` (float8_e4m3fn ``[N, K]``) and ``weight_scale`` (``[N, 1]`` per channel;
``[1]`` or ``[]`` per tensor, which :func:`per_row_scales` expands to the shard's rows, exactly);
layers in ``ignore`` (e.g. ``lm_head``) are stored dense and stay dense. Every other field value
that changes the math (static activation scales, block or group strategies, weight-only FP8, a KV
cache scheme, other bit widths) is refused by name before any weight is read.

>>> scheme = Fp8CheckpointScheme.from_config(config.quantization_config)   # ValueError if not runnable
>>> formats = scheme.weight_formats(checkpoint.weight_shapes())           # {"...q_proj.weight": "fp8_e4m3"}
"""
from __future__ import annotations

from dataclasses import dataclass

FP8_FORMAT = "fp8_e4m3"
_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
_UNSET_FIELDS = ("group_size", "block_structure", "actorder")


@dataclass(frozen=True, slots=True)
class Fp8CheckpointScheme:
    """A compressed-tensors FP8 W8A8 scheme this engine runs; ``weight_strategy``: ``"channel"`` or ``"tensor"``."""

    weight_strategy: str

    @classmethod
    def from_config(cls, quant_config: dict) -> "Fp8CheckpointScheme":
        """The scheme of ``quantization_config``; ValueError naming the first field we do not run."""
        _expect(quant_config, "format", ("float-quantized",))
        if quant_config.get("kv_cache_scheme") is not None:
            raise ValueError("config.json: quantization_config.kv_cache_scheme is set; an FP8 KV cache from the "
                             "checkpoint is not supported yet")
        groups = quant_config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"config.json: quantization_config.config_groups has {len(groups)} groups; exactly one "
                             "(FP8 W8A8 for every Linear) is supported")
        (group_name, group), = groups.items()
        where = f"quantization_config.config_groups.{group_name}"
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"config.json: {where}.targets={group.get('targets')!r} is not supported; ['Linear'] is")
        weights = group.get("weights") or {}
        for field, value in _WEIGHTS.items():
            _expect(weights, field, (value,), f"{where}.weights")
        _expect(weights, "strategy", ("channel", "tensor"), f"{where}.weights")
        activations = group.get("input_activations")
        if activations is None:
            raise ValueError(f"config.json: {where}.input_activations=None (FP8 weight-only) is not supported; "
                             "dynamic per-token FP8 activations are")
        for field, value in _ACTIVATIONS.items():
            _expect(activations, field, (value,), f"{where}.input_activations")
        for part, name in ((weights, "weights"), (activations, "input_activations")):
            for field in _UNSET_FIELDS:
                if part.get(field) is not None:
                    raise ValueError(f"config.json: {where}.{name}.{field}={part[field]!r} is not supported")
        if group.get("output_activations") is not None:
            raise ValueError(f"config.json: {where}.output_activations is not supported")
        return cls(weights["strategy"])

    def weight_formats(self, shapes) -> dict[str, str]:
        """``{weight name: "fp8_e4m3"}`` for every weight stored with a ``weight_scale`` beside it."""
        if shapes is None:
            raise ValueError("compressed-tensors checkpoints must be safetensors (their headers name the scales)")
        return {name[:-len("_scale")]: FP8_FORMAT for name in shapes if name.endswith(".weight_scale")}

    def per_row_scales(self, name: str, tensor, weight_rows: dict[str, int]):
        """``weight_scale`` as ``[rows, 1]`` (a per-tensor scale repeated on its rows); other tensors as they are."""
        if self.weight_strategy != "tensor" or not name.endswith(".weight_scale"):
            return tensor
        rows = weight_rows[name[:-len("_scale")]]
        return tensor.reshape(1, 1).float().expand(rows, 1)

    def weights(self, stream, shapes):
        """The checkpoint's stream as the model receives it (per-tensor scales per row)."""
        return per_row_scale_stream(self, stream, shapes)

    def checkpoint_shapes(self, shapes):
        """The headers' shapes as the model will receive them (per-tensor scales per row)."""
        if self.weight_strategy != "tensor":
            return shapes
        result = dict(shapes)
        for name, (shape, file) in shapes.items():
            if name.endswith(".weight_scale"):
                result[name] = ((shapes[name[:-len("_scale")]][0][0], 1), file)
        return result


def _expect(section: dict, field: str, allowed: tuple, where: str = "quantization_config") -> None:
    value = section.get(field)
    if value not in allowed:
        raise ValueError(f"config.json: {where}.{field}={value!r} is not supported; supported: {list(allowed)}")


def per_row_scale_stream(scheme: Fp8CheckpointScheme, weights, shapes):
    """``checkpoint.weights()`` with per-tensor scales expanded per row (see :meth:`per_row_scales`)."""
    rows = {name: shape[0] for name, (shape, _) in shapes.items() if len(shape) == 2}
    for name, tensor in weights:
        yield name, scheme.per_row_scales(name, tensor, rows)

