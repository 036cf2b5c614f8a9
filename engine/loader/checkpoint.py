"""What every loader returns: a config, a tokenizer, and the weights as a stream.

Weights are not read when a checkpoint is opened: the model is built and the config and the
weight names and shapes (from the files' headers) are checked first, then :meth:`weights` yields
one ``(Hugging Face name, tensor)`` at a time and the model pulls each into place.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

# name -> (shape, file it is stored in), read from headers without reading tensor data.
WeightShapes = dict[str, tuple[tuple[int, ...], str]]


class LoadedCheckpoint:
    """A model checkpoint ready for our model classes.

    Weights use Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``), so one
    model implementation serves every file format. A value is a tensor in the file's dtype (the
    model's weight loaders convert while copying), or a quantized tensor the loader keeps as
    stored (e.g. :class:`~.gguf_blocks.GGUFBlocks`; ``weight_formats`` names those up front so
    the model can choose matching linear methods before loading).

    >>> checkpoint = load_checkpoint("default", torch.bfloat16)
    >>> name, tensor = next(checkpoint.weights())
    >>> checkpoint.weight_formats["model.layers.0.mlp.up_proj.weight"]
    'Q4_1'

    ``state_dict`` (every weight dequantized to ``dtype``, all in memory) stays for tools that want a dict.
    """

    def __init__(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, source: str,
                 state_dict: dict[str, torch.Tensor] | None = None, *,
                 weight_stream: Callable[[], Iterator[tuple[str, Any]]] | None = None,
                 weight_shapes: WeightShapes | None = None, weight_formats: dict[str, str] | None = None,
                 dtype: torch.dtype | None = None,
                 device_weight_stream: Callable[[torch.device], Iterator[tuple[str, Any]]] | None = None) -> None:
        if (state_dict is None) == (weight_stream is None):
            raise ValueError("LoadedCheckpoint needs exactly one of state_dict and weight_stream")
        self.config = config
        self.tokenizer = tokenizer
        self.source = source
        self.dtype = dtype
        self.weight_formats = dict(weight_formats or {})
        # The user's LLM(quantization=...), set by load_checkpoint; checked by the model loader.
        self.quantization: str | None = None
        self._state_dict = state_dict
        self._weight_stream = weight_stream
        self._device_weight_stream = device_weight_stream
        self._materialized = None
        if weight_shapes is None and state_dict is not None:
            weight_shapes = {name: (tuple(tensor.shape), source) for name, tensor in state_dict.items()}
        self._weight_shapes = weight_shapes

    def weights(self, device: torch.device | None = None) -> Iterator[tuple[str, Any]]:
        """Each weight once, read as it is yielded (safetensors file by file, GGUF tensor by tensor).

        ``device``: where the weights are going. A CUDA device lets a format that can read straight
        into device memory do so (safetensors, through pinned buffers: ``staged_reads.py``); the
        tensors then come out on that device, in the file's dtype. Others ignore it.
        """
        if self._state_dict is not None:
            return iter(list(self._state_dict.items()))
        if device is not None and torch.device(device).type == "cuda" and self._device_weight_stream is not None:
            return self._device_weight_stream(torch.device(device))
        return self._weight_stream()

    def weight_shapes(self) -> WeightShapes | None:
        """``name -> (shape, file)`` without reading tensor data; None where the format cannot
        tell (pickled ``.bin`` files), in which case shapes are checked while loading."""
        return self._weight_shapes

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight as a dense tensor in ``dtype`` (the loader's compute dtype), all in memory
        (made on first use and kept; the engine itself streams :meth:`weights` instead)."""
        if self._state_dict is not None:
            return self._state_dict
        if self._materialized is not None:
            return self._materialized
        result = {}
        for name, value in self.weights():
            dequantized = getattr(value, "dequantized", None)
            tensor = dequantized(self.dtype or torch.float32) if dequantized is not None else value
            result[name] = tensor.to(self.dtype) if self.dtype is not None else tensor
        self._materialized = result  # kept: callers index it repeatedly
        return result
