"""Load a llama.cpp GGUF file as a Hugging Face-style checkpoint, cached as safetensors.

The first load reads the file's metadata, builds a transformers config and tokenizer from it,
converts every tensor under its Hugging Face name, and writes all of that to a cache directory.
Matrices in llama.cpp's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay in
their blocks (:class:`GGUFBlocks`, the q/k row order undone row-wise, which is exact), so a model
can run them quantized; every other tensor is dequantized to the compute dtype. Later loads of the
same file read only the cache, which takes well under a second for a small model instead of
seconds of parsing and dequantizing. Weights stream out of the cache file tensor by tensor.

A cached load does not import transformers' per-architecture config classes: in
transformers 5 importing ``LlamaConfig`` pulls in ``torch.distributed.tensor`` and sympy, about a
second of a cold start. The config comes back as a bare ``PretrainedConfig`` subclass that knows
its ``model_type`` and holds every field (our models read only attributes; ``save_pretrained``
writes a config.json that transformers reads as the architecture's own class), and the first
load returns the same, so both loads agree.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from .checkpoint import LoadedCheckpoint
from .gguf_blocks import BLOCK_TYPES, GGUFBlocks
from .gguf_spec import GGUFArchitecture

# Bump when the conversion changes, so caches written by an older loader are not reused.
# 2: config.json holds every field (not only those that differ from the defaults).
# 3: Q4_0/Q4_1 tensors kept as uint8 blocks, their types in the weights file's metadata.
# 4: every block type of gguf_blocks.BLOCK_TYPES kept (Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K too).
_CACHE_FORMAT_VERSION = 4
_BLOCKS_METADATA_KEY = "hearth_gguf_blocks"
_CONFIG_FILE = "config.json"
_DEFAULT_CACHE_ROOT = Path("~/.cache/hearth_llm/gguf")
_WEIGHTS_FILE = "model.safetensors"
_GGUF_MAGIC = b"GGUF"
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Which llama.cpp architectures load, and how, is declared by the model files
# (GGUFArchitecture in gguf_spec.py, registered with engine/models/registry.py).
_LLAMA_SPEC = GGUFArchitecture(config_class="LlamaConfig", permuted_qk=True)
_GLOBAL_TENSOR = re.compile(r"(?P<name>\w+)\.(?P<kind>weight|bias)")
_LAYER_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<name>\w+)\.(?P<kind>weight|bias)")
# One expert's tensor as llama.cpp wrote Mixtral before it stacked experts (early 2024 and older
# files: blk.N.ffn_gate.E.weight); named after the stacked tensor (ffn_gate_exps) of the same kind.
_EXPERT_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<name>\w+)\.(?P<expert>\d+)\.(?P<kind>weight|bias)")

# Llama 3.1+ GGUFs store their rope scaling as per-frequency factors in this tensor.
_ROPE_FACTORS_TENSOR = "rope_freqs.weight"
# The Llama 3 scaling parameters that llama.cpp folds into `rope_freqs`; only `factor` varies.
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_MISSING = object()


def load_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> LoadedCheckpoint:
    """Load a llama.cpp GGUF file as Hugging Face config, weights and tokenizer.

    Tensors are renamed to Hugging Face names; block-quantized matrices stay in their blocks
    (:class:`GGUFBlocks`), the others are dequantized to `dtype`; llama.cpp's q/k row permutation
    is undone so the weights work with rotate-half rotary. Weights are not read until
    ``checkpoint.weights()`` streams them. The result is cached
    under `cache_dir` (default ``~/.cache/hearth_llm/gguf``), one sub-directory per file version and
    dtype, so the next load skips the conversion.

    Supported architectures: those the model files register (``engine/models/registry.py``;
    llama, mistral, qwen2, qwen3 and more).

    Example:
        >>> checkpoint = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", torch.bfloat16)
        >>> checkpoint.config.num_hidden_layers
        30
        >>> checkpoint.state_dict["model.layers.0.self_attn.q_proj.weight"].shape
        torch.Size([576, 576])

    Raises:
        ValueError: `dtype` is not float32, float16 or bfloat16, or the file is not a GGUF file,
            is truncated, or uses an unsupported architecture, tensor or quantization type.
        FileNotFoundError: `path` does not exist.
    """
    _check_dtype(dtype)
    gguf_path = Path(path)
    cache_path = _cache_root(cache_dir) / _cache_key(gguf_path, dtype)
    if cache_path.is_dir():
        return _load_from_cache(cache_path, source=str(gguf_path), dtype=dtype)
    converted = _convert_gguf(gguf_path, dtype, progress)
    if _write_cache(converted, cache_path):
        # Stream from the cache file: the converted tensors need not stay in memory.
        return _load_from_cache(cache_path, source=str(gguf_path), dtype=dtype)
    return converted.checkpoint(str(gguf_path), dtype)


def unpermute_llama_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a q or k projection (weight or bias) for Hugging Face rotary.

    llama.cpp rotates adjacent pairs of each head's dimensions, Hugging Face rotates the first half
    against the second half. llama.cpp's converter therefore interleaves each head's two halves;
    this puts them back. Pass the number of query heads for q and of key/value heads for k.

    Example:
        >>> unpermute_llama_qk(torch.arange(8.0), num_heads=1).tolist()
        [0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]
    """
    num_rows = weight.shape[0]
    if num_heads <= 0 or num_rows % (2 * num_heads) != 0:
        raise ValueError(
            f"num_heads must be positive and divide the {num_rows} rows into heads of even size, got {num_heads}"
        )
    rows_per_half_head = num_rows // num_heads // 2
    interleaved = weight.reshape(num_heads, rows_per_half_head, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()


def hf_tensor_name(gguf_name: str, spec: GGUFArchitecture = _LLAMA_SPEC) -> str | None:
    """The Hugging Face parameter name for a llama.cpp tensor name in architecture ``spec``
    (default Llama's), or None if it has none.

    Example:
        >>> hf_tensor_name("blk.3.attn_output.weight")
        'model.layers.3.self_attn.o_proj.weight'
    """
    if match := _LAYER_TENSOR.fullmatch(gguf_name):
        module, prefix = spec.layer_tensor_names.get(match["name"]), f"model.layers.{match['layer']}."
    elif match := _GLOBAL_TENSOR.fullmatch(gguf_name):
        module, prefix = spec.all_global_tensor_names.get(match["name"]), ""
    elif match := _EXPERT_TENSOR.fullmatch(gguf_name):
        stem, marker, part = spec.layer_tensor_names.get(f"{match['name']}_exps", "").partition(".experts.")
        module, prefix = (f"{stem}.experts.{match['expert']}.{part}" if marker else None), f"model.layers.{match['layer']}."
    else:
        return None
    return None if module is None else f"{prefix}{module}.{match['kind']}"


# --- cache -------------------------------------------------------------------------------------


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _SUPPORTED_DTYPES))}, got {dtype!r}")


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir if cache_dir is not None else _DEFAULT_CACHE_ROOT).expanduser()


def _cache_key(gguf_path: Path, dtype: torch.dtype) -> str:
    # Size and mtime stand in for a content hash: hashing gigabytes would cost more than converting.
    stat = gguf_path.stat()
    identity = f"v{_CACHE_FORMAT_VERSION}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


@dataclass(slots=True)
class _Converted:
    """A converted file in memory: dense tensors, and block tensors under ``blocks``' names."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerFast
    tensors: dict[str, torch.Tensor]      # blocks as their uint8 data
    blocks: dict[str, str]                # name -> "Q4_0", "Q4_K", ...

    def value(self, name: str):
        quant_type = self.blocks.get(name)
        return self.tensors[name] if quant_type is None else GGUFBlocks(quant_type, self.tensors[name])

    def checkpoint(self, source: str, dtype: torch.dtype) -> LoadedCheckpoint:
        shapes = {name: (tuple(self.value(name).shape), source) for name in self.tensors}
        return LoadedCheckpoint(self.config, self.tokenizer, source, dtype=dtype, weight_shapes=shapes,
                                weight_formats=dict(self.blocks),
                                weight_stream=lambda: ((name, self.value(name)) for name in self.tensors))


def _load_from_cache(cache_path: Path, source: str, dtype: torch.dtype) -> LoadedCheckpoint:
    config_dict = json.loads((cache_path / _CONFIG_FILE).read_text(encoding="utf-8"))
    config = _config_class(config_dict["model_type"]).from_dict(config_dict)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cache_path, local_files_only=True)
    weights_file = cache_path / _WEIGHTS_FILE
    with safe_open(weights_file, framework="pt") as reader:
        blocks = json.loads((reader.metadata() or {}).get(_BLOCKS_METADATA_KEY, "{}"))
        shapes = {}
        for name in reader.keys():
            shape = tuple(reader.get_slice(name).get_shape())
            if name in blocks:  # stored as bytes: the logical shape has 32 values per block
                shape = (shape[0], GGUFBlocks.logical_columns(blocks[name], shape[1]))
            shapes[name] = (shape, source)
    return LoadedCheckpoint(config, tokenizer, source, dtype=dtype, weight_shapes=shapes, weight_formats=blocks,
                            weight_stream=lambda: _stream_cache(weights_file, blocks))


def _stream_cache(weights_file: Path, blocks: dict[str, str]):
    with safe_open(weights_file, framework="pt") as reader:
        for name in reader.keys():
            tensor = reader.get_tensor(name)
            yield name, (GGUFBlocks(blocks[name], tensor) if name in blocks else tensor)


def _write_cache(converted: _Converted, cache_path: Path) -> bool:
    """Whether the cache now holds this conversion."""
    try:
        _write_cache_atomically(converted, cache_path)
    except OSError as error:
        # A concurrent load of the same file may have renamed its identical cache into place first.
        if not cache_path.is_dir():
            # The cache only saves time, so a full or read-only disk should not fail the load.
            warnings.warn(f"Not caching the converted GGUF at {cache_path}: {error}", RuntimeWarning, stacklevel=3)
            return False
    return True


def _write_cache_atomically(converted: _Converted, cache_path: Path) -> None:
    """Write into a staging directory and rename it, so a crash never leaves a half-written cache."""
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_path.name}.", suffix=".partial", dir=cache_path.parent))
    try:
        metadata = {"format": "pt", _BLOCKS_METADATA_KEY: json.dumps(converted.blocks)}
        save_file(converted.tensors, staging / _WEIGHTS_FILE, metadata=metadata)
        (staging / _CONFIG_FILE).write_text(converted.config.to_json_string(use_diff=False), encoding="utf-8")
        converted.tokenizer.save_pretrained(staging)
        os.rename(staging, cache_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@functools.cache
def _config_class(model_type: str) -> type[PretrainedConfig]:
    """A ``PretrainedConfig`` subclass with this ``model_type`` and no defaults of its own."""
    return type(f"{model_type.title()}GGUFConfig", (PretrainedConfig,), {"model_type": model_type})


# --- conversion --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    """The key/value metadata of one GGUF file, with errors that name the file."""

    values: dict[str, Any]
    path: Path

    @property
    def architecture(self) -> str:
        architecture = self.values.get("general.architecture")
        if _spec_for(architecture) is None:
            raise ValueError(
                f"{self.path}: architecture {architecture!r} is not supported; supported: {sorted(_registered())}"
            )
        return architecture

    @property
    def spec(self) -> GGUFArchitecture:
        """The registered entry for this file: a variant under its architecture name (Mixtral
        under ``llama``) when one applies to these metadata, else the architecture's own."""
        return _spec_for(self.architecture, self)

    def model_value(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``<architecture>.<key>``, e.g. ``llama.block_count``."""
        full_key = f"{self.architecture}.{key}"
        value = self.values.get(full_key, default)
        if value is _MISSING:
            raise ValueError(f"{self.path}: metadata key {full_key!r} is missing")
        return value

    def token(self, id_key: str) -> str | None:
        """The token text whose id is stored under ``tokenizer.ggml.<id_key>``, if any."""
        token_id = self.values.get(f"tokenizer.ggml.{id_key}")
        return None if token_id is None else self.values["tokenizer.ggml.tokens"][token_id]


def _registered() -> dict[str, GGUFArchitecture]:
    from ..models.registry import GGUF_ARCHITECTURES, import_model_files

    if not GGUF_ARCHITECTURES:
        import_model_files()
    return GGUF_ARCHITECTURES


def _spec_for(architecture, metadata: GGUFMetadata | None = None) -> GGUFArchitecture | None:
    from ..models.registry import gguf_architecture

    _registered()
    return gguf_architecture(architecture, metadata)


def _convert_gguf(gguf_path: Path, dtype: torch.dtype, progress: bool) -> _Converted:
    reader = _open_gguf(gguf_path)
    metadata = GGUFMetadata(values=_read_metadata(reader), path=gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    try:
        config = _build_config(metadata, tensors)
        tokenizer = _build_tokenizer(metadata)
        converted, blocks = _convert_tensors(metadata, config, tensors, dtype, progress)
    except Exception as error:  # transformers' config classes validate with their own exception types
        if isinstance(error, ValueError) and str(gguf_path) in str(error):
            raise
        raise ValueError(f"{gguf_path}: its metadata describe an unusable model: {error}") from error
    return _Converted(config=config, tokenizer=tokenizer, tensors=converted, blocks=blocks)


def _open_gguf(gguf_path: Path) -> GGUFReader:
    with open(gguf_path, "rb") as file:
        if file.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ValueError(f"{gguf_path} is not a GGUF file: it does not start with the bytes {_GGUF_MAGIC!r}")
    try:
        return GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError, OverflowError) as error:
        # The reader fails with whatever numpy says when a header or tensor runs past the end.
        raise ValueError(f"{gguf_path} is truncated or corrupt: {error}") from error


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _field_value(field: ReaderField) -> Any:
    # Parsed by hand rather than with `ReaderField.contents()`, which older gguf releases lack.
    if field.types[0] == GGUFValueType.ARRAY:
        return [_scalar_value(field.parts[index], field.types[-1]) for index in field.data]
    return _scalar_value(field.parts[field.data[0]], field.types[0])


def _scalar_value(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if value_type == GGUFValueType.FLOAT32:
        # The shortest float32 spelling, so an rms eps of 1e-5 reads back as 1e-5, not 9.99999974e-6.
        return float(str(part[0]))
    return part[0].item()


# --- config ------------------------------------------------------------------------------------


def _build_config(metadata: GGUFMetadata, tensors: dict[str, ReaderTensor]) -> PretrainedConfig:
    num_heads = metadata.model_value("attention.head_count")
    hidden_size = metadata.model_value("embedding_length")
    head_dim = metadata.model_value("attention.key_length", hidden_size // num_heads)
    rope_theta = metadata.model_value("rope.freq_base", 10000.0)
    config_kwargs = dict(
        vocab_size=metadata.model_value("vocab_size", len(metadata.values.get("tokenizer.ggml.tokens", ()))),
        hidden_size=hidden_size,
        intermediate_size=metadata.model_value("feed_forward_length"),
        num_hidden_layers=metadata.model_value("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=metadata.model_value("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=metadata.model_value("context_length"),
        # transformers 5 folds `rope_theta` into `config.rope_parameters`; 4.x keeps `config.rope_theta`.
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(metadata, tensors, rope_dim=metadata.model_value("rope.dimension_count", head_dim)),
        bos_token_id=metadata.values.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.values.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.values.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )
    rms_eps = metadata.model_value("attention.layer_norm_rms_epsilon", None)
    if rms_eps is not None:
        config_kwargs["rms_norm_eps"] = rms_eps
    elif metadata.model_value("attention.layer_norm_epsilon", None) is None:
        metadata.model_value("attention.layer_norm_rms_epsilon")  # neither: the error names the key
    # else a LayerNorm model: its config_fields put attention.layer_norm_epsilon where its config wants it.
    spec = metadata.spec
    if spec.config_fields is not None:
        config_kwargs.update(spec.config_fields(metadata))
    import transformers

    config = getattr(transformers, spec.config_class)(**config_kwargs)
    # The architecture's class only fills in its defaults; what we return is what a cached load returns.
    return _config_class(config.model_type).from_dict(config.to_dict())


def _rope_scaling(metadata: GGUFMetadata, tensors: dict[str, ReaderTensor], rope_dim: int) -> dict | None:
    if _ROPE_FACTORS_TENSOR in tensors:
        rope_factors = dequantize(tensors[_ROPE_FACTORS_TENSOR].data, tensors[_ROPE_FACTORS_TENSOR].tensor_type)
        return _llama3_rope_scaling(metadata, rope_factors, rope_dim)
    scaling_type = metadata.model_value("rope.scaling.type", "none")
    factor = metadata.model_value("rope.scaling.factor", 1.0)
    if scaling_type == "none" or (scaling_type == "linear" and factor == 1.0):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"{metadata.path}: rope scaling type {scaling_type!r} is not supported; supported: linear, yarn"
        )
    scaling = {"rope_type": scaling_type, "factor": factor}
    original_context_length = metadata.model_value("rope.scaling.original_context_length", None)
    if original_context_length:
        scaling["original_max_position_embeddings"] = original_context_length
    return scaling


def _llama3_rope_scaling(metadata: GGUFMetadata, rope_factors: np.ndarray, rope_dim: int) -> dict:
    """Recover Llama 3 rope scaling parameters from the per-frequency factors llama.cpp stored.

    Only `factor` can be read off directly (it is the largest one); the other parameters are
    assumed to be Llama 3's and the result is checked against the stored factors.
    """
    scaling = {"rope_type": "llama3", "factor": float(rope_factors.max()), **_LLAMA3_ROPE_DEFAULTS}
    rope_theta = metadata.model_value("rope.freq_base", 10000.0)
    expected = _llama3_rope_factors(scaling, rope_dim, rope_theta)
    if expected.shape != rope_factors.shape or not np.allclose(expected, rope_factors, rtol=1e-3):
        raise ValueError(
            f"{metadata.path}: tensor {_ROPE_FACTORS_TENSOR!r} does not match Llama 3 rope scaling "
            f"with factor {scaling['factor']}; other per-frequency rope factors are not supported"
        )
    return scaling


def _llama3_rope_factors(scaling: dict, rope_dim: int, rope_theta: float) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3 rope scaling."""
    inverse_frequencies = 1.0 / rope_theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelengths = 2 * math.pi / inverse_frequencies
    original_length = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (original_length / wavelengths - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    is_high_frequency = wavelengths < original_length / high
    is_low_frequency = wavelengths > original_length / low
    return np.where(is_high_frequency, 1.0, np.where(is_low_frequency, factor, blended)).astype(np.float32)


# --- tokenizer ---------------------------------------------------------------------------------


def _build_tokenizer(metadata: GGUFMetadata) -> PreTrainedTokenizerFast:
    tokenizer_model = metadata.values.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in metadata.values:
        raise ValueError(f"{metadata.path}: metadata key 'tokenizer.ggml.tokens' is missing, so there is no tokenizer")
    key_names, convert_gguf_tokenizer = _transformers_tokenizer_converter()
    try:
        backend, converter_kwargs = convert_gguf_tokenizer(metadata.architecture, _renamed(metadata, key_names))
    except (KeyError, ValueError, NotImplementedError) as error:
        raise ValueError(
            f"{metadata.path}: cannot build a tokenizer for tokenizer.ggml.model={tokenizer_model!r}: {error}"
        ) from error
    special_tokens = {
        "bos_token": metadata.token("bos_token_id"),
        "eos_token": metadata.token("eos_token_id"),
        "pad_token": metadata.token("padding_token_id"),
        "unk_token": metadata.token("unknown_token_id"),
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{
            **converter_kwargs,
            **special_tokens,
            # llama.cpp prepends BOS to sentencepiece ("llama") vocabularies unless told otherwise.
            "add_bos_token": metadata.values.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"),
            "add_eos_token": metadata.values.get("tokenizer.ggml.add_eos_token", False),
            "chat_template": metadata.values.get("tokenizer.chat_template"),
        },
    )


def _renamed(metadata: GGUFMetadata, key_names: dict[str, str]) -> dict[str, Any]:
    """The tokenizer metadata under the names transformers' converter expects (``tokens``, ``merges``...)."""
    return {
        name: metadata.values[f"tokenizer.{key}"]
        for key, name in key_names.items()
        if f"tokenizer.{key}" in metadata.values
    }


def _transformers_tokenizer_converter():
    """transformers' GGUF tokenizer converter and its metadata key names, wherever this version keeps them."""
    try:  # transformers 5.x
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING["tokenizer"], convert_gguf_tokenizer


# --- tensors -----------------------------------------------------------------------------------


def _convert_tensors(
    metadata: GGUFMetadata,
    config: PretrainedConfig,
    tensors: dict[str, ReaderTensor],
    dtype: torch.dtype,
    progress: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """HF name -> tensor (dense in ``dtype``, or blocks as uint8 data), and the block tensors' types."""
    spec = metadata.spec
    permuted_heads = _permuted_heads(spec, config)
    state_dict, blocks = {}, {}
    description = f"Converting {metadata.path.name}"
    progress_bar = tqdm(tensors.values(), desc=description, unit="tensor", disable=not progress)
    for tensor in progress_bar:
        if tensor.name == _ROPE_FACTORS_TENSOR or tensor.name in spec.ignored_tensors:
            continue  # rope factors: already folded into config.rope_scaling
        hf_name = hf_tensor_name(tensor.name, spec)
        if hf_name is None:
            raise ValueError(
                f"{metadata.path}: tensor {tensor.name!r} has no Hugging Face {metadata.architecture} name"
            )
        num_heads = permuted_heads.get(hf_name.rsplit(".", 2)[-2])
        if tensor.tensor_type.name in BLOCK_TYPES and len(tensor.data.shape) == 2:
            weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # rows of blocks, out of the mmap
            blocks[hf_name] = tensor.tensor_type.name
        else:
            weight = _dequantize(tensor, metadata.path)
            if spec.transform_tensor is not None:
                weight = spec.transform_tensor(hf_name, weight, config)
            weight = weight.to(dtype)
        if num_heads is not None:  # a permutation of whole rows: exact on blocks too
            weight = unpermute_llama_qk(weight, num_heads)
        state_dict[hf_name] = weight
    return state_dict, blocks


def _permuted_heads(spec: GGUFArchitecture, config: PretrainedConfig) -> dict[str, int]:
    """Projection name -> head count for the tensors llama.cpp permuted in this architecture."""
    if not spec.permuted_qk:
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def _dequantize(tensor: ReaderTensor, gguf_path: Path) -> torch.Tensor:
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(
            f"{gguf_path}: tensor {tensor.name!r} uses quantization type {tensor.tensor_type.name}, "
            "which the installed gguf package cannot dequantize"
        ) from error
    # F32 tensors come back as read-only views of the memory-mapped file; copy those out of it.
    return torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C_CONTIGUOUS", "WRITEABLE"]))
