"""The decoder-only model every architecture here is a variant of, and how checkpoints load into it.

:class:`DecoderModel` is embedding → layers → final norm → LM head, with the residual stream
carried between layers. An architecture file subclasses it and says only what differs:

* ``arch_class`` / ``arch_fields(config)``: the facts it reads from the config;
* ``check_config(config)``: refuse fields it does not implement (``ValueError`` naming the field);
* ``layer_class`` or ``make_layer``: its decoder layer (norm placement, parallel blocks, MoE);
* ``make_norm``, ``embed``, ``compute_logits``: norms, embedding scale, logit scale/soft-cap
  (most are ``ArchConfig`` fields the base already applies);
* ``packed_modules_mapping`` / ``checkpoint_renames`` / ``ignored_checkpoint_weights``: how
  Hugging Face weight names map onto our fused parameters.

Weights arrive as a stream of ``(name, tensor)`` (:meth:`DecoderModel.load_weights`); each goes
to its parameter's ``weight_loader(param, tensor, shard_id)``. :meth:`check_checkpoint` checks
names and shapes from the checkpoint's headers before anything is read or allocated.

Adding an architecture (a new file in this package registers itself)::

    @register_model("OlmoForCausalLM", model_types=("olmo",),
                    gguf={"olmo": GGUFArchitecture(config_class="OlmoConfig")})
    class OlmoForCausalLM(DecoderModel):
        layer_class = OlmoDecoderLayer          # e.g. LayerNorm without weights

        @classmethod
        def check_config(cls, config):
            super().check_config(config)
            refuse_if(config, "clip_qkv", lambda v: v is not None, cls)
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from . import cpu_step, fused_decode
from .arch import ArchConfig
from .attention import Attention, AttentionMetadata
from .cpu_weights import cpu_block_embedding, cpu_logits_head, resident_blocks
from .linear import linear_layers
from .mlp import GatedMLP
from .norms import RMSNorm
from .rotary import RotaryEmbedding, is_per_layer_type, rope_parameters


def refuse_if(config: PretrainedConfig, field: str, is_unsupported: Callable[[Any], bool], model_class) -> None:
    """``ValueError`` naming ``field`` and its value when ``is_unsupported(value)``.

    >>> refuse_if(config, "hidden_act", lambda act: act != "silu", LlamaForCausalLM)
    ValueError: config.json: hidden_act='gelu' is not supported by LlamaForCausalLM here
    """
    value = getattr(config, field, None)
    if is_unsupported(value):
        raise ValueError(f"config.json: {field}={value!r} is not supported by {model_class.__name__} here")


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping)."""
    return torch.tanh(x / cap) * cap


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP, each added to the residual stream (Llama)."""

    def __init__(self, arch: ArchConfig, layer_index: int, rotary: RotaryEmbedding, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = Attention.from_arch(arch, layer_index, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias,
                            prefix=f"{prefix}.mlp", owner=arch.architecture)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if hidden.shape[0] <= fused_decode.MAX_ROWS and hidden.device.type in fused_decode.DEVICE_TYPES \
                and self._fuses_decode:
            return self._fused_decode_forward(positions, hidden, residual, kv_cache, meta)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    @property
    def _fuses_decode(self) -> bool:
        """Whether this is the plain layer :mod:`.fused_decode` knows (subclasses may swap parts)."""
        return (type(self.self_attn) is Attention and type(self.mlp) is GatedMLP
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm)

    def _fused_decode_forward(self, positions, hidden, residual, kv_cache, meta):
        """The same layer with each norm inside the matmul after it and SwiGLU inside ``down_proj``
        (on CUDA, for a dense weight; else the unfused ops: see :mod:`.fused_decode`)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = fused_decode.norm_and_linear(self.input_layernorm, hidden, residual, attn.qkv_proj)
        hidden = fused_decode.linear(attn.o_proj, attn.attend_heads(positions, qkv, kv_cache, meta))
        return fused_decode.norm_and_mlp(self.post_attention_layernorm, mlp, hidden, residual)


class DecoderModel(nn.Module):
    """See the module docstring. ``forward`` returns the final hidden states; ``compute_logits``
    turns the rows the sampler needs into logits."""

    arch_class: type[ArchConfig] = ArchConfig
    layer_class: type[nn.Module] = DecoderLayer
    # HF module name -> (our fused module, shard id), matched on whole dotted name components.
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # HF module name -> ours, for modules that are not fused but named differently (``c_fc``).
    checkpoint_renames: dict[str, str] = {}
    # Checkpoint tensors that hold nothing we need (substrings of the name).
    ignored_checkpoint_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)
    checkpoint_prefix = "model."
    # Rope types a fixed cos/sin table reproduces exactly (see rotary.RUNTIME_ROPE_TYPES).
    supported_rope_types = frozenset({"default", "linear", "llama3", "yarn"})

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        # An explicit weight skips the random init, which the checkpoint overwrites anyway; on the
        # meta device that init (normal_) first imports torch._dynamo, most of a second of load time.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        rotaries = self.make_rotaries()
        self.layers = nn.ModuleList(self.make_layer(i, rotaries[arch.layer_type(i)])
                                    for i in range(arch.num_hidden_layers))
        self.norm = self.make_norm()
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # --- building ----------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Refuse config fields this model does not implement; extend in subclasses."""
        layer_types = (getattr(config, "layer_types", None) or [None]) if is_per_layer_type(config) else [None]
        for layer_type in set(layer_types):
            rope_type = rope_parameters(config, layer_type)["rope_type"]
            if rope_type not in cls.supported_rope_types:
                raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not supported by {cls.__name__} "
                                 f"here; supported: {sorted(cls.supported_rope_types)}")

    @classmethod
    def arch_fields(cls, config: PretrainedConfig) -> dict:
        """ArchConfig fields this architecture sets itself (e.g. Qwen2's ``attention_bias=True``)."""
        return {}

    @classmethod
    def arch_from_hf_config(cls, config: PretrainedConfig) -> ArchConfig:
        cls.check_config(config)
        return cls.arch_class.from_hf_config(config, **cls.arch_fields(config))

    def make_rotaries(self) -> dict[str, RotaryEmbedding]:
        """One rotary table per distinct layer type (one shared table when they agree)."""
        arch, tables = self.arch, {}
        kinds = {arch.layer_type(i): i for i in range(arch.num_hidden_layers)}
        shared = None
        for kind, layer_index in kinds.items():
            if arch.rope_by_layer_type is None and shared is not None:
                tables[kind] = shared
                continue
            inv_freq, scaling = arch.rope_for_layer(layer_index)
            tables[kind] = shared = RotaryEmbedding(inv_freq, arch.max_position_embeddings, scaling, arch.is_neox_style)
        return tables

    def make_layer(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return self.layer_class(self.arch, layer_index, rotary, prefix=f"layers.{layer_index}")

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.arch.hidden_size, self.arch.rms_norm_eps)

    def materialize_buffers(self, dtype: torch.dtype) -> None:
        """After building on the meta device: recompute the rotary tables and re-tie the head."""
        device = self.embed_tokens.weight.device
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.materialize(device, dtype)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # --- running -----------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.arch.embedding_multiplier is not None:
            hidden = hidden * self.arch.embedding_multiplier
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        # A CPU step of a few rows through plain layers: the ops between the matmuls in C (see cpu_step).
        done = cpu_step.run_layers(self, hidden, positions, kv_caches, meta) if hidden.device.type == "cpu" else None
        if done is not None:
            hidden, residual = done
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = fused_decode.lm_head(self.lm_head, hidden)
        if self.arch.logits_multiplier is not None:
            logits = logits * self.arch.logits_multiplier
        if self.arch.final_logit_softcap is not None:
            logits = soft_cap(logits, self.arch.final_logit_softcap)
        return logits

    # --- loading -----------------------------------------------------------------------------

    def param_for_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """``(our parameter name, shard id)`` for a checkpoint tensor name; None to skip it.

        >>> model.param_for_checkpoint_name("model.layers.0.self_attn.k_proj.weight")
        ('layers.0.self_attn.qkv_proj.weight', 'k')
        """
        if any(ignored in name for ignored in self.ignored_checkpoint_weights):
            return None
        name = name.removeprefix(self.checkpoint_prefix)
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return None
        parts, shard_id = name.split("."), None
        for index, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                parts[index], shard_id = self.packed_modules_mapping[part]
            elif part in self.checkpoint_renames:
                parts[index] = self.checkpoint_renames[part]
        return ".".join(parts), shard_id

    def checkpoint_name(self, param_name: str, shard_id=None) -> str:
        """The Hugging Face name a parameter's shard is stored under (the inverse of
        :meth:`param_for_checkpoint_name`), for messages that name what a checkpoint lacks."""
        unpacked = {value: part for part, value in self.packed_modules_mapping.items()}
        renamed = {ours: theirs for theirs, ours in self.checkpoint_renames.items()}
        parts = param_name.split(".")
        for index, part in enumerate(parts):
            if shard_id is not None and (part, shard_id) in unpacked:
                parts[index] = unpacked[(part, shard_id)]
            elif part in renamed:
                parts[index] = renamed[part]
        name = ".".join(parts)
        return name if name.startswith("lm_head.") else self.checkpoint_prefix + name

    def expected_checkpoint_shards(self) -> dict[str, list]:
        """Every parameter a checkpoint must fill, with the shard ids it loads in."""
        params = dict(self.named_parameters())
        if self.arch.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        layers = {name: layer for name, layer in linear_layers(self)}
        shards = {}
        for name in params:
            module_name, _, _ = name.rpartition(".")
            layer = layers.get(module_name)
            shards[name] = list(layer.shard_ids) if layer is not None else [None]
        return shards

    def check_checkpoint(self, shapes: Mapping[str, tuple[tuple[int, ...], str]], source: str) -> None:
        """Names and shapes (``name -> (shape, file)``, from the checkpoint's headers) against
        the config, before any weight is read; ``ValueError`` naming the file and the weight."""
        params = dict(self.named_parameters())
        expected = self.expected_checkpoint_shards()
        covered: dict[str, set] = {}
        for name, (shape, file) in shapes.items():
            target = self.param_for_checkpoint_name(name)
            if target is None:
                continue
            param_name, shard_id = target
            if param_name not in expected:
                raise ValueError(f"{file}: weight {name!r} is not a weight of {type(self).__name__} as config.json "
                                 f"describes it")
            param = params[param_name]
            checkpoint_shape = getattr(param, "checkpoint_shape", None)
            want = tuple(checkpoint_shape(shard_id)) if checkpoint_shape is not None else tuple(param.shape)
            if tuple(shape) != want:
                raise ValueError(f"{file}: weight {name!r} has shape {tuple(shape)}; config.json "
                                 f"(hidden_size={self.arch.hidden_size}, intermediate_size="
                                 f"{self.arch.intermediate_size}, heads={self.arch.num_attention_heads}/"
                                 f"{self.arch.num_key_value_heads}, head_dim={self.arch.head_dim}, "
                                 f"vocab_size={self.arch.vocab_size}) makes it {want}")
            covered.setdefault(param_name, set()).update(expected[param_name] if shard_id is None else [shard_id])
        _check_complete(expected, covered, source, self.checkpoint_name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """Pull each ``(name, tensor)`` into its parameter; each linear layer repacks (oneDNN
        layouts, int4 packing) as soon as all its weights are in, the LM head last: this is the
        model's last setup step.

        Repacking layer by layer keeps the peak memory near the model's final size: a plain weight
        is freed right after its packed copy exists, while most of the model is still unread.
        ``weights`` is a stream (a checkpoint's ``weights()``) or a dict of Hugging Face names.
        """
        if isinstance(weights, Mapping):
            weights = weights.items()
        params = dict(self.named_parameters())
        expected = self.expected_checkpoint_shards()
        layers = dict(linear_layers(self))
        covered: dict[str, set] = {}
        for name, tensor in weights:
            target = self.param_for_checkpoint_name(name)
            if target is None:
                continue
            param_name, shard_id = target
            if param_name not in expected:
                raise ValueError(f"checkpoint has weight {name!r} that {type(self).__name__} does not expect")
            if param_name not in params:
                raise ValueError(f"checkpoint has weight {name!r} more than once")
            _load_one(params[param_name], tensor, shard_id, name)
            covered.setdefault(param_name, set()).update(expected[param_name] if shard_id is None else [shard_id])
            # GGUF blocks of the embedding/head may stay blocks on the CPU (a tied pair shares them)
            blocks = resident_blocks(tensor, params[param_name].dtype) \
                if params[param_name] is self.embed_tokens.weight or params[param_name] is self.lm_head.weight else None
            if params[param_name] is self.embed_tokens.weight:
                self.embed_tokens = cpu_block_embedding(self.embed_tokens, blocks)
            if params[param_name] is self.lm_head.weight:
                self.lm_head = cpu_logits_head(self.lm_head, blocks)  # now, while little else is resident
            del tensor, blocks
            module_name = param_name.rpartition(".")[0]
            if module_name in layers and _is_layer_complete(module_name, expected, covered):
                for layer_param in [n for n in params if n.rpartition(".")[0] == module_name]:
                    del params[layer_param]  # our reference must not keep the plain weight alive
                layers.pop(module_name).process_weights_after_loading()
        _check_complete(expected, covered, "checkpoint", self.checkpoint_name)
        del params
        for layer in layers.values():  # layers with nothing to load (none today)
            layer.process_weights_after_loading()

    def finish_loading(self) -> None:
        """Repack every linear layer and the LM head, for a model filled in some other way."""
        for _, layer in linear_layers(self):
            layer.process_weights_after_loading()
        self.lm_head = cpu_logits_head(self.lm_head)


def _load_one(param: nn.Parameter, tensor, shard_id, name: str) -> None:
    try:
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as error:
        raise ValueError(f"weight {name!r}: {error}") from None


def _is_layer_complete(module_name: str, expected: dict[str, list], covered: dict[str, set]) -> bool:
    return all(set(shards) <= covered.get(name, set()) for name, shards in expected.items()
               if name.rpartition(".")[0] == module_name)


def default_weight_loader(param: nn.Parameter, loaded_weight) -> None:
    """Copy a whole tensor (dequantized first when it is quantized) into ``param``."""
    from .linear_method import dense_value

    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise ValueError(f"has shape {tuple(loaded_weight.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(dense_value(loaded_weight, param.dtype))


def _check_complete(expected: dict[str, list], covered: dict[str, set], source: str,
                    checkpoint_name=lambda name, shard: name) -> None:
    missing = [checkpoint_name(name, shard) for name, shards in expected.items()
               for shard in shards if shard not in covered.get(name, set())]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{source} is missing weights: {', '.join(missing[:5])}{more}")
