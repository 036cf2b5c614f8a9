"""Mixture-of-experts layers, and the decoder model every MoE architecture here is a variant of.

* :class:`FusedMoE`: one layer's experts as two stacked parameters (``w13_weight`` ``[E, 2 I, H]``,
  gate rows then up rows; ``w2_weight`` ``[E, H, I]``) run by ``kernels.moe`` (Triton on CUDA, a
  sort-by-expert path on CPU). Each parameter's ``weight_loader(param, tensor, shard_id,
  expert_id)`` puts a checkpoint tensor into its slice, so per-expert hub tensors
  (``experts.3.gate_proj``, Mixtral's ``experts.3.w1``) and transformers 5's fused in-memory
  tensors (``experts.gate_up_proj``) stream into the same place.
* :class:`SparseMoeBlock`: router (a linear to E logits), top-k routing with the model's
  normalisation, the experts, and optionally Qwen2-MoE's shared expert behind a sigmoid gate.
* :class:`MoeDecoderLayer` / :class:`MoeDecoderModel`: the Llama-shaped decoder whose feed-forward
  block is sparse on the layers the config says (``mlp_only_layers``, ``decoder_sparse_step``).

Tensor parallelism (:func:`shard_experts`, as vLLM's ``FusedMoE``): every rank keeps every expert
and the router whole, but only its ``intermediate_size / N`` slice of each expert: gate and up
rows (column-parallel), the matching down columns (row-parallel). Each rank's experts then give
a partial sum of the block's output; the shared expert's down projection skips its own
all-reduce, and one all-reduce per block sums routed plus shared (the sigmoid gate scales each
token, so it distributes over the sum: exact).

>>> moe = FusedMoE(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, renormalize=True)
>>> moe.w13_weight.weight_loader(moe.w13_weight, torch.ones(8, 16), "up", 3)  # rows 8..15 of expert 3
>>> moe(torch.randn(5, 16), router_logits=torch.randn(5, 4)).shape
torch.Size([5, 16])
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from hearth_llm.kernels import moe as moe_kernels

from .arch import ArchConfig
from .decoder import DecoderLayer, DecoderModel, refuse_if
from .linear import SINGLE_PROCESS, ReplicatedLinear, RowLinear, TensorParallel
from .linear_method import dense_value
from .mlp import GatedMLP


class ExpertShard(NamedTuple):
    """Which part of which expert a checkpoint tensor fills: ``kind`` is ``"gate"``, ``"up"`` or
    ``"down"``; ``expert`` None means the tensor stacks that part of every expert (``[E, ...]``)."""

    kind: str
    expert: int | None = None


class FusedMoE(nn.Module):
    """The experts of one MoE layer; ``forward(x, router_logits)`` routes and runs them."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 prefix: str = "") -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.prefix = prefix
        self.parallel = SINGLE_PROCESS
        self._create()

    # --- tensor parallelism ---------------------------------------------------------------------

    @property
    def intermediate_size_per_rank(self) -> int:
        return self.intermediate_size // self.parallel.size

    def configure(self, parallel: TensorParallel) -> None:
        """Hold only ``parallel``'s slice of every expert; before loading (the tensors are
        re-created empty, on the device of the current ones)."""
        if self.intermediate_size % parallel.size:
            raise ValueError(f"tensor_parallel_size={parallel.size} must divide the experts' intermediate size "
                             f"{self.intermediate_size} (moe_intermediate_size) of {self.prefix!r}")
        self.parallel = parallel
        self._create()

    def _create(self) -> None:
        device = self.w13_weight.device if "w13_weight" in self._parameters else None
        width = self.intermediate_size_per_rank
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.w13_weight = nn.Parameter(torch.empty(self.num_experts, 2 * width, self.hidden_size),
                                           requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, width), requires_grad=False)
        self._attach_loaders()

    # --- loading ------------------------------------------------------------------------------

    @property
    def shard_ids(self) -> dict[str, list[ExpertShard]]:
        """Per parameter, the per-expert shards a hub checkpoint fills it with."""
        experts = range(self.num_experts)
        return {"w13_weight": [ExpertShard(kind, e) for kind in ("gate", "up") for e in experts],
                "w2_weight": [ExpertShard("down", e) for e in experts]}

    def _attach_loaders(self) -> None:
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
            param.checkpoint_shape = lambda shard_id=None, _param=param: self.checkpoint_shape(_param, shard_id)

    def _apply(self, fn, recurse=True):
        # Moving between devices (to_empty from meta) makes new Parameter objects: re-attach.
        module = super()._apply(fn, recurse)
        self._attach_loaders()
        return module

    def _target(self, param: nn.Parameter, shard: ExpertShard | None) -> torch.Tensor:
        """The slice of ``param`` a shard fills (all of it for None)."""
        if shard is None:
            return param.data
        self._check_shard(param, shard)
        experts = param.data if shard.expert is None else param.data[shard.expert]
        if shard.kind == "down":
            return experts
        width = self.intermediate_size_per_rank
        rows = slice(0, width) if shard.kind == "gate" else slice(width, None)
        return experts[..., rows, :]

    def _check_shard(self, param: nn.Parameter, shard: ExpertShard) -> None:
        is_w13 = param is self.w13_weight
        if (shard.kind == "down") == is_w13 or shard.kind not in ("gate", "up", "down"):
            name = "w13_weight" if is_w13 else "w2_weight"
            raise ValueError(f"{self.prefix}: shard kind {shard.kind!r} does not load into {name}")
        if shard.expert is not None and not 0 <= shard.expert < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {shard.expert} is out of range: the config has "
                             f"num_experts={self.num_experts}")

    def checkpoint_shape(self, param: nn.Parameter, shard_id=None) -> tuple[int, ...]:
        """The shape the checkpoint stores a shard in: the whole experts, whatever this rank keeps."""
        shard = _as_shard(shard_id)
        hidden, width = self.hidden_size, self.intermediate_size
        if shard is None:
            return ((self.num_experts, 2 * width, hidden) if param is self.w13_weight
                    else (self.num_experts, hidden, width))
        self._check_shard(param, shard)
        shape = (hidden, width) if shard.kind == "down" else (width, hidden)
        return shape if shard.expert is not None else (self.num_experts, *shape)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None, expert_id: int | None = None) -> None:
        """Copy ``loaded_weight`` into its slice: ``shard_id`` ``"gate"``/``"up"``/``"down"`` of expert
        ``expert_id`` (or of all experts, stacked, when ``expert_id`` is None), an
        :class:`ExpertShard`, or None for the whole stacked parameter. Under tensor parallelism
        only this rank's columns of the intermediate width are kept (see the module docstring)."""
        shard = ExpertShard(shard_id, expert_id) if isinstance(shard_id, str) else _as_shard(shard_id)
        expected = self.checkpoint_shape(param, shard)
        if tuple(loaded_weight.shape) != tuple(expected):
            raise ValueError(f"{self.prefix} ({shard}) has shape {tuple(loaded_weight.shape)}, the config makes it "
                             f"{tuple(expected)}")
        self._target(param, shard).copy_(self._rank_slice(param, shard, dense_value(loaded_weight, param.dtype)))

    def _rank_slice(self, param: nn.Parameter, shard: ExpertShard | None, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint value: gate/up rows, down columns (dequantized
        first, so a GGUF block never has to be cut)."""
        if self.parallel.size == 1:
            return value
        width = self.intermediate_size_per_rank
        start = self.parallel.rank * width
        if param is self.w2_weight:
            return value.narrow(-1, start, width)
        if shard is None:  # [E, 2 I, H]: gate rows then up rows, each cut
            gate, up = value.split(self.intermediate_size, dim=-2)
            return torch.cat((gate.narrow(-2, start, width), up.narrow(-2, start, width)), dim=-2)
        return value.narrow(-2, start, width)

    # --- running -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = moe_kernels.select_experts(router_logits, self.top_k, self.renormalize)
        return moe_kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        split = f" (of {self.intermediate_size})" if self.parallel.size > 1 else ""
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_rank}{split}, renormalize={self.renormalize}")


def _as_shard(shard_id) -> ExpertShard | None:
    if shard_id is None or isinstance(shard_id, ExpertShard):
        return shard_id
    return ExpertShard(*shard_id)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert_intermediate_size: int | None = None, hidden_act: str = "silu", prefix: str = "",
                 owner: str = "this model") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                prefix=f"{prefix}.experts")
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, hidden_act,
                                          prefix=f"{prefix}.shared_expert", owner=owner)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
        else:
            self.shared_expert = self.shared_expert_gate = None

    parallel = SINGLE_PROCESS  # set by shard_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, router_logits=self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.parallel.size > 1:  # routed and shared partial sums, reduced once
            self.parallel.all_reduce(out)
        return out


def shard_experts(model: nn.Module, parallel: TensorParallel) -> None:
    """Give every MoE block of ``model`` (built on meta, before loading) ``parallel``'s slice:
    each expert's intermediate columns, and one all-reduce per block (the shared expert's down
    projection leaves its partial sum to it). ``ValueError`` naming the layer when the ranks do
    not divide the experts' width."""
    if parallel.size == 1:
        return
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.configure(parallel)
        elif isinstance(module, SparseMoeBlock):
            module.parallel = parallel
            if module.shared_expert is not None:
                down = module.shared_expert.down_proj
                assert isinstance(down, RowLinear), type(down)
                down.reduce_results = False


@dataclass(slots=True)
class MoeArch(ArchConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int | None = None
    sparse_layers: tuple[bool, ...] = ()   # per layer: MoE block (True) or dense MLP (False)

    def is_sparse_layer(self, layer_index: int) -> bool:
        return self.sparse_layers[layer_index]


class MoeDecoderLayer(DecoderLayer):
    """A Llama-shaped decoder layer whose feed-forward block is a :class:`SparseMoeBlock` where
    ``arch.sparse_layers`` says so (named ``mlp`` either way, as transformers 5 names it)."""

    def __init__(self, arch: MoeArch, layer_index: int, rotary, prefix: str = "") -> None:
        super().__init__(arch, layer_index, rotary, prefix)
        if arch.is_sparse_layer(layer_index):
            self.mlp = SparseMoeBlock(arch.hidden_size, arch.num_experts, arch.num_experts_per_tok,
                                      arch.moe_intermediate_size, arch.norm_topk_prob,
                                      arch.shared_expert_intermediate_size, arch.hidden_act, prefix=f"{prefix}.mlp",
                                      owner=arch.architecture)


class MoeDecoderModel(DecoderModel):
    """A :class:`DecoderModel` with :class:`MoeDecoderLayer` layers and expert checkpoint names.

    Subclasses set ``expert_names`` (hub names of an expert's gate, up and down projections) and
    implement :meth:`moe_fields` (the config's MoE facts as :class:`MoeArch` fields).
    """

    arch_class = MoeArch
    layer_class = MoeDecoderLayer
    expert_names: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # transformers 5 in memory: every expert's gate and up in one [E, 2 I, H] tensor, down in [E, H, I].
    fused_expert_names = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        # The expert kernels fuse SiLU-and-mul; the dense and shared MLPs would take others, the experts not.
        refuse_if(config, "hidden_act", lambda act: act != "silu", cls)

    @classmethod
    def moe_fields(cls, config) -> dict:
        raise NotImplementedError

    @classmethod
    def arch_fields(cls, config) -> dict:
        fields = cls.moe_fields(config)
        _check_moe_fields(fields, config.num_hidden_layers)
        return fields

    def param_for_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Expert tensors to ``(…mlp.experts.w13_weight / w2_weight, ExpertShard)``; the rest as the base.

        >>> model.param_for_checkpoint_name("model.layers.0.mlp.experts.5.up_proj.weight")
        ('layers.0.mlp.experts.w13_weight', ExpertShard(kind='up', expert=5))
        """
        stem, marker, rest = name.partition(".experts.")
        if not marker:
            return super().param_for_checkpoint_name(name)
        target = super().param_for_checkpoint_name(f"{stem}.experts")
        if target is None:
            return None
        experts = target[0]
        parts = rest.split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in self.expert_names and parts[2] == "weight":
            kind = self.expert_names[parts[1]]
            return f"{experts}.{'w2_weight' if kind == 'down' else 'w13_weight'}", ExpertShard(kind, int(parts[0]))
        if len(parts) == 2 and parts[0] in self.expert_names and parts[1] == "weight":  # GGUF: [E, ...]
            kind = self.expert_names[parts[0]]
            return f"{experts}.{'w2_weight' if kind == 'down' else 'w13_weight'}", ExpertShard(kind, None)
        if len(parts) == 1 and parts[0] in self.fused_expert_names:
            return f"{experts}.{self.fused_expert_names[parts[0]]}", None
        return f"{experts}.{rest}", None  # not a weight we have: the loader names it

    def _is_stacked(self, name: str) -> bool:
        """Whether a checkpoint tensor stacks one part of every expert (``experts.gate_proj.weight``,
        from llama.cpp's ``ffn_gate_exps``), rather than holding one expert's."""
        target = self.param_for_checkpoint_name(name)
        return target is not None and isinstance(target[1], ExpertShard) and target[1].expert is None

    def _per_expert_names(self, name: str, num_experts: int) -> list[str]:
        stem, _, rest = name.partition(".experts.")
        return [f"{stem}.experts.{expert}.{rest}" for expert in range(num_experts)]

    def check_checkpoint(self, shapes, source: str) -> None:
        per_expert = {}
        for name, (shape, file) in shapes.items():
            if self._is_stacked(name):
                per_expert.update((split, (tuple(shape[1:]), file)) for split in self._per_expert_names(name, shape[0]))
            else:
                per_expert[name] = (shape, file)
        super().check_checkpoint(per_expert, source)

    def load_weights(self, weights) -> None:
        """As :meth:`DecoderModel.load_weights`; tensors stacking every expert's gate, up or down
        (GGUF) are split into per-expert views as they stream past."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        super().load_weights(self._split_stacked(items))

    def _split_stacked(self, items):
        for name, tensor in items:
            if self._is_stacked(name):
                yield from zip(self._per_expert_names(name, tensor.shape[0]), tensor.unbind(0))
            else:
                yield name, tensor

    def expected_checkpoint_shards(self) -> dict[str, list]:
        shards = super().expected_checkpoint_shards()
        for module_name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                for param_name, ids in module.shard_ids.items():
                    shards[f"{module_name}.{param_name}"] = ids
        return shards


# llama.cpp's tensor names of an MoE block (``blk.N.<name>``), and the HF modules they hold.
GGUF_EXPERT_TENSOR_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                            "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
GGUF_SHARED_EXPERT_TENSOR_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                                   "ffn_up_shexp": "mlp.shared_expert.up_proj",
                                   "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_GGUF_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def gguf_moe_config_fields(metadata, renormalize_by_default: bool) -> dict:
    """Config fields of a llama.cpp MoE file: expert counts and sizes, and whether the top-k
    weights are renormalised (``expert_weights_norm``, else what llama.cpp does for the architecture)."""
    gating = metadata.model_value("expert_gating_func", _GGUF_SOFTMAX_GATING)
    if gating != _GGUF_SOFTMAX_GATING:
        raise ValueError(f"{metadata.path}: {metadata.architecture}.expert_gating_func={gating!r} is not supported "
                         f"here; only softmax routing ({_GGUF_SOFTMAX_GATING})")
    fields = dict(num_experts=metadata.model_value("expert_count"),
                  num_experts_per_tok=metadata.model_value("expert_used_count"),
                  moe_intermediate_size=metadata.model_value("expert_feed_forward_length"),
                  norm_topk_prob=bool(metadata.model_value("expert_weights_norm", renormalize_by_default)))
    shared = metadata.model_value("expert_shared_feed_forward_length", None)
    if shared is not None:
        fields["shared_expert_intermediate_size"] = shared
    return fields


def sparse_layer_pattern(num_layers: int, num_experts: int, decoder_sparse_step, mlp_only_layers) -> tuple[bool, ...]:
    """Qwen MoE's rule: layer i is sparse unless listed in ``mlp_only_layers``, when there are
    experts and ``(i + 1) % decoder_sparse_step == 0``."""
    return tuple(i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
                 for i in range(num_layers))


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_moe_fields(fields: dict, num_layers: int) -> None:
    """``ValueError`` naming the config field whose value cannot make a MoE model."""
    sparse = fields["sparse_layers"]
    if not any(sparse):
        return
    num_experts = fields["num_experts"]
    if not _is_positive_int(num_experts):
        raise ValueError(f"config.json: the number of experts must be a positive integer, got {num_experts!r}")
    top_k = fields["num_experts_per_tok"]
    if not _is_positive_int(top_k) or top_k > num_experts:
        raise ValueError(f"config.json: num_experts_per_tok must be an integer in [1, {num_experts}], got {top_k!r}")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        value = fields.get(name)
        if (name == "moe_intermediate_size" or value is not None) and not _is_positive_int(value):
            raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")


def config_num_experts(config) -> int:
    """Qwen MoE's expert count: ``num_experts``, which transformers 5 stores as ``num_local_experts``
    (an attribute alias a plain config, e.g. one built from GGUF metadata, does not have)."""
    value = getattr(config, "num_experts", None)
    return value if value is not None else getattr(config, "num_local_experts", 0)


def checked_sparse_step(config) -> int:
    step = getattr(config, "decoder_sparse_step", 1)
    if not _is_positive_int(step):
        raise ValueError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    return step


def checked_mlp_only_layers(config) -> list[int]:
    layers = getattr(config, "mlp_only_layers", None) or []
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in layers):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {layers!r:.80}")
    return list(layers)


__all__ = ["GGUF_EXPERT_TENSOR_NAMES", "GGUF_SHARED_EXPERT_TENSOR_NAMES", "ExpertShard", "FusedMoE", "MoeArch", "MoeDecoderLayer", "MoeDecoderModel", "SparseMoeBlock",
           "checked_mlp_only_layers", "checked_sparse_step", "config_num_experts", "gguf_moe_config_fields",
           "shard_experts", "sparse_layer_pattern"]
