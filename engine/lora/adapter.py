"""Reading a Hugging Face PEFT LoRA directory and fitting it onto our model's linear layers.

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with tensors
``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
Each HF module maps onto one of our linear layers and a shard of it through the model's own
checkpoint mapping (``q_proj`` → shard ``"q"`` of ``qkv_proj``, ``up_proj`` → shard 1 of
``gate_up_proj``; Phi-3's fused ``qkv_proj`` → the whole layer), so every architecture the
loader knows takes adapters without a table of its own.

Everything is checked here, before an adapter reaches the engine: the config fields (anything
that changes the math and is not implemented raises ``ValueError`` naming the field), the rank
against ``max_lora_rank``, every target against the model's layers, every tensor's shape.

>>> adapter = load_adapter(LoRARequest("sql", "/adapters/sql"), LoRATargets.of(model), max_lora_rank=64)
>>> adapter.rank, adapter.scaling, sorted(adapter.layers)[:1]
(8, 2.0, ['layers.0.self_attn.qkv_proj'])
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from .request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Fields that do not change inference (training, initialisation, bookkeeping) or that this module
# implements. Any other field with a set value is refused by name: it may change the math.
_HARMLESS_FIELDS = frozenset({
    "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "peft_type", "task_type",
    "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights", "lora_dropout",
    "layers_to_transform", "layers_pattern", "auto_mapping", "peft_version", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size", "ensure_weight_tying",
    "bias", "fan_in_fan_out", "use_dora",  # checked for their one supported value below
})
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(slots=True)
class ShardLoRA:
    """One target's matrices: ``a`` ``[r, in]`` and ``b_scaled`` ``[r, rows]`` (lora_B transposed,
    times the adapter's scale), for output rows ``row_start : row_start + rows`` of block ``block``."""

    block: int
    row_start: int
    a: torch.Tensor
    b_scaled: torch.Tensor


@dataclass(slots=True)
class LoRATargets:
    """What an adapter may target: each linear layer's input size, output rows per shard and the
    model's HF-name mapping. Built once from the model (read-only afterwards, safe across threads)."""

    param_for_checkpoint_name: object            # the model's (HF name) -> (our param, shard) mapping
    layers: dict[str, "LayerShape"] = field(default_factory=dict)

    @classmethod
    def of(cls, model) -> "LoRATargets":
        from ..models.linear import linear_layers

        shapes = {name: LayerShape.of(layer) for name, layer in linear_layers(model)}
        return cls(model.param_for_checkpoint_name, shapes)


@dataclass(frozen=True, slots=True)
class LayerShape:
    input_size: int
    output_size: int
    shard_ids: tuple
    shard_rows: dict                              # shard id -> (first row, rows)

    @property
    def num_blocks(self) -> int:
        """Rank blocks of this layer's slots: one per shard (q, k, v each get their own A and B)."""
        return len(self.shard_ids)

    @classmethod
    def of(cls, layer) -> "LayerShape":
        if layer.parallel.size > 1:
            # Tensor parallelism (TP's hook): adapters fit the whole layer; each rank's LoRA method
            # keeps its cut when it loads a slot (models/tp_lora.py).
            shards = tuple(layer.shard_ids)
            starts = [sum(layer.output_sizes[:i]) for i in range(len(shards))]
            rows = {shard: (start, size) for shard, start, size in zip(shards, starts, layer.output_sizes)
                    if shard is not None}
            rows[None] = (0, layer.output_size)
            return cls(layer.input_size, layer.output_size, shards, rows)
        shards = tuple(layer.shard_ids)
        rows = {shard: layer.shard_rows(shard) for shard in shards if shard is not None}
        rows[None] = (0, layer.output_size_per_rank)
        return cls(layer.input_size_per_rank, layer.output_size_per_rank, shards, rows)


@dataclass(slots=True, eq=False)
class LoRAAdapter:
    """A loaded, checked adapter on the CPU, in our layers' terms (see :class:`ShardLoRA`).

    ``cache_key`` names its exact weights (name and a hash of its files): prefix-cache blocks and
    device slots are keyed by it, so a re-added adapter with new weights never reuses old KV.
    """

    name: str
    path: str
    rank: int
    scaling: float
    cache_key: str
    layers: dict[str, list[ShardLoRA]]

    @property
    def num_bytes(self) -> int:
        return sum(s.a.nbytes + s.b_scaled.nbytes for shards in self.layers.values() for s in shards)


def load_adapter(request: LoRARequest, targets: LoRATargets, max_lora_rank: int) -> LoRAAdapter:
    """Read and check ``request.path``; ``ValueError`` naming the adapter and the field on any problem."""
    name = request.name
    if request.path is None:
        raise ValueError(f"LoRA adapter {name!r}: no path given and no adapter of that name is known")
    directory = Path(request.path).expanduser()
    config_bytes = _read(name, directory / CONFIG_FILE)
    weights_bytes = _read(name, directory / WEIGHTS_FILE, hint="(a .bin adapter: save it with safe_serialization=True)")
    try:
        config = json.loads(config_bytes)
    except ValueError as error:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON: {error}") from None
    rank, scaling = _check_config(name, config, max_lora_rank)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {error}") from None
    layers = _fit_to_layers(name, tensors, targets, rank, scaling)
    digest = hashlib.sha256(config_bytes + weights_bytes).hexdigest()[:24]
    return LoRAAdapter(name, str(directory), rank, scaling, f"{name}:{digest}", layers)


def _read(name: str, path: Path, hint: str = "") -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {error.strerror or error} {hint}".rstrip()) from None


def _check_config(name: str, config: dict, max_lora_rank: int) -> tuple[int, float]:
    """``(rank, scale)`` from ``adapter_config.json``, refusing what is not implemented."""
    def refuse(field_name: str, why: str = "is not supported here") -> None:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} {field_name}={config.get(field_name)!r} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "is not supported here (only LORA)")
    for field_name, value in config.items():
        if field_name not in _HARMLESS_FIELDS and value not in (None, False, {}, [], "", 0):
            refuse(field_name)
    if config.get("use_dora"):
        refuse("use_dora", "is not supported here (DoRA)")
    if config.get("bias", "none") != "none":
        refuse("bias", "is not supported here (only 'none')")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
        # These change the base weights during training; unless converted to a plain LoRA on save
        # (peft's path_initial_model_for_weight_conversion), the adapter is only right on that base.
        refuse("init_lora_weights", "expects a modified base model; save it converted to a plain LoRA")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    for target in targets:
        if any(refused in target for refused in _REFUSED_TARGETS):
            refuse("target_modules", f"targets {target!r}: embedding and lm_head adapters are not supported here")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        refuse("r", "must be a positive int")
    if rank > max_lora_rank:
        refuse("r", f"is above max_lora_rank={max_lora_rank}; raise max_lora_rank")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        refuse("lora_alpha", "must be a finite number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _fit_to_layers(name: str, tensors: dict, targets: LoRATargets, rank: int,
                   scaling: float) -> dict[str, list[ShardLoRA]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight (DoRA magnitudes, "
                             "biases, embeddings and modules_to_save are not supported here)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    layers: dict[str, list[ShardLoRA]] = {}
    for module, pair in sorted(pairs.items()):
        layer_name, shard_id, shape = _target_layer(name, module, targets)
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        first_row, num_rows = shape.shard_rows[shard_id]
        _check_shape(name, module, "lora_A", a, (rank, shape.input_size))
        _check_shape(name, module, "lora_B", b, (num_rows, rank))
        block = 0 if shard_id is None else shape.shard_ids.index(shard_id)
        shard = ShardLoRA(block, first_row, a.float().contiguous(), (b.float().T * scaling).contiguous())
        layers.setdefault(layer_name, []).append(shard)
    return layers


def _target_layer(name: str, module: str, targets: LoRATargets):
    if any(part in _REFUSED_TARGETS for part in module.split(".")):
        raise ValueError(f"LoRA adapter {name!r}: target {module} is an embedding or lm_head; not supported here")
    mapped = targets.param_for_checkpoint_name(module + ".weight")
    layer_name = mapped[0].removesuffix(".weight") if mapped is not None else None
    if layer_name is None or layer_name not in targets.layers:
        raise ValueError(f"LoRA adapter {name!r}: target module {module} is not a linear layer of this model "
                         "(an adapter for another architecture?)")
    shape = targets.layers[layer_name]
    shard_id = mapped[1]
    if shard_id not in shape.shard_rows:
        raise ValueError(f"LoRA adapter {name!r}: target module {module} maps to shard {shard_id!r} of {layer_name}, "
                         f"which has shards {list(shape.shard_ids)}")
    return layer_name, shard_id, shape


def _check_shape(name: str, module: str, which: str, tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"LoRA adapter {name!r}: {module}.{which} has shape {tuple(tensor.shape)}, this model and "
                         f"the adapter's r make it {expected} (an adapter of another base model?)")
