"""Random-weight checkpoints of real shapes, under the names checkpoints on the Hugging Face hub use.

transformers 5 keeps each MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
``[E, 2 I, H]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``), while the hub's
safetensors hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight`` ...). A benchmark
that hands our loader the fused form would test a path no real checkpoint takes, so both ways of
building a checkpoint here give hub names:

- :func:`hub_state_dict` renames an HF model's state dict, splitting fused experts into views
  (no copy), for runs that keep the HF model as the reference;
- :class:`RandomWeights` makes each tensor on the device only when the loader reads it, so a
  30B-parameter model is built on the GPU holding one copy of the weights plus one tensor.

>>> from transformers import Qwen3MoeConfig
>>> config = Qwen3MoeConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
...                         head_dim=4, moe_intermediate_size=4, num_experts=2, num_experts_per_tok=1,
...                         vocab_size=16, architectures=["Qwen3MoeForCausalLM"])
>>> shapes = checkpoint_shapes(config, torch.float32)
>>> shapes["model.layers.0.mlp.experts.1.up_proj.weight"]
(4, 8)
>>> weights = RandomWeights(shapes, torch.float32, "cpu", std=config.initializer_range)
>>> weights["model.layers.0.mlp.experts.1.up_proj.weight"].shape
torch.Size([4, 8])
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

# In-memory segment -> hub segment, and the hub names of an expert's gate / up / down projections.
HUB_EXPERT_NAMES = {
    "Qwen2MoeForCausalLM": (".mlp.", ".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeForCausalLM": (".mlp.", ".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": (".mlp.", ".block_sparse_moe.", ("w1", "w3", "w2")),
}


def hub_state_dict(state_dict: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """``state_dict`` (an HF model's, as transformers 5 names it in memory) under hub names:
    fused experts split into per-expert views of the same storage. Dense architectures come back
    unchanged.

    >>> names = list(hub_state_dict(model.state_dict(), model.config))  # doctest: +SKIP
    >>> names[7]  # doctest: +SKIP
    'model.layers.0.mlp.experts.0.gate_proj.weight'
    """
    architecture = config.architectures[0]
    if architecture not in HUB_EXPERT_NAMES:
        return dict(state_dict)
    in_memory, hub, (gate, up, down) = HUB_EXPERT_NAMES[architecture]
    num_experts = _num_experts(config)
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    hidden = config.hidden_size
    renamed = {}
    for name, tensor in state_dict.items():
        prefix = name.replace(in_memory, hub).rpartition("experts.")[0] + "experts."  # used by experts only
        if name.endswith(".experts.gate_up_proj"):
            _check_layout(name, tensor, (num_experts, 2 * intermediate, hidden))
            for expert in range(num_experts):
                renamed[f"{prefix}{expert}.{gate}.weight"] = tensor[expert, :intermediate]
                renamed[f"{prefix}{expert}.{up}.weight"] = tensor[expert, intermediate:]
        elif name.endswith(".experts.down_proj"):
            _check_layout(name, tensor, (num_experts, hidden, intermediate))
            for expert in range(num_experts):
                renamed[f"{prefix}{expert}.{down}.weight"] = tensor[expert]
        elif ".experts." in name and name.rpartition(".experts.")[2].count(".") == 0:
            # Any other fused expert tensor (biases, scales) would be dropped silently below.
            raise ValueError(f"{name}: fused expert tensor of an unknown kind; hub names for it are not known here")
        else:
            renamed[name.replace(in_memory, hub)] = tensor
    return renamed


def checkpoint_shapes(config, dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """Every tensor a hub checkpoint of ``config`` holds, ``name -> shape``, read off the HF model
    built on the meta device (nothing allocated). A tied ``lm_head.weight`` is left out, as the
    hub's tied checkpoints leave it out."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return {name: tuple(tensor.shape) for name, tensor in hub_state_dict(state_dict, config).items()}


class RandomWeights(Mapping):
    """``name -> tensor`` for the given shapes, each tensor made on ``device`` when it is read and
    not kept: a loader that copies each one into its parameter and drops it holds the model plus
    one tensor. Values follow HF's initialisation (normal with ``std``, norm weights 1, biases 0);
    each tensor's seed comes from its name, so reading one twice gives the same values.

    >>> weights = RandomWeights({"model.norm.weight": (4,), "lm_head.weight": (3, 4)}, torch.float32, "cpu", 0.02)
    >>> weights["model.norm.weight"].tolist(), weights.num_bytes
    ([1.0, 1.0, 1.0, 1.0], 64)
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, device: str | torch.device,
                 std: float, seed: int = 0) -> None:
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.std = std
        self.seed = seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]  # KeyError for an unknown name, as a dict
        if name.rpartition(".")[0].endswith("norm"):  # input_layernorm, q_norm, model.norm, ...
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))  # the CPU generator keeps 32 bits
        return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, self.std, generator=generator)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def num_bytes(self) -> int:
        """What the weights take in ``dtype``, none of them made."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) for shape in self.shapes.values()) * element_size


def _num_experts(config) -> int:
    for field in ("num_experts", "num_local_experts"):
        if getattr(config, field, None):
            return getattr(config, field)
    raise ValueError(f"{type(config).__name__} names no expert count (num_experts / num_local_experts)")


def _check_layout(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    # A transformers version with another fused layout would otherwise be split into wrong experts.
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name}: fused experts of shape {tuple(tensor.shape)}, expected {expected} "
                         f"(experts, rows, columns); this transformers version lays experts out differently")
