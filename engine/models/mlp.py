"""Feed-forward blocks: the gated MLP (``down(act(gate(x)) * up(x))``, Llama and most others) and
the plain one (``down(act(up(x)))``, StarCoder2).

>>> mlp = GatedMLP(hidden_size=64, intermediate_size=128, hidden_act="gelu_pytorch_tanh")
>>> mlp(torch.randn(3, 64)).shape
torch.Size([3, 64])
"""
from __future__ import annotations

import torch
from torch import nn

from .activations import activation, gated_activation
from .linear import ColumnLinear, MergedColumnLinear, RowLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 prefix: str = "", owner: str = "this model") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                               prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act_and_mul = gated_activation(hidden_act, owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))``; checkpoint names are mapped onto ``up_proj``/``down_proj``
    by the model's ``packed_modules_mapping`` or ``checkpoint_renames``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True,
                 prefix: str = "", owner: str = "this model") -> None:
        super().__init__()
        self.up_proj = ColumnLinear(hidden_size, intermediate_size, bias=bias, prefix=f"{prefix}.up_proj")
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act = activation(hidden_act, owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
