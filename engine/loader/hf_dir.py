"""Open a Hugging Face model directory: config.json, tokenizer files and (sharded) safetensors.

Opening reads the config, the tokenizer and the safetensors headers (names, shapes), not the
weights: they stream out of :meth:`LoadedCheckpoint.weights`, one file open at a time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint import LoadedCheckpoint, WeightShapes


def load_hf_dir(path: str | Path, dtype: torch.dtype, allow_pickle: bool = False, progress: bool = True) -> LoadedCheckpoint:
    """Open ``path`` (a directory with config.json). Pickled ``.bin`` weights need ``allow_pickle=True``.

    >>> checkpoint = load_hf_dir("models/tiny-llama", torch.float32)
    >>> checkpoint.weight_shapes()["lm_head.weight"]
    ((320, 64), 'models/tiny-llama/model.safetensors')
    """
    # Imported here: resolving transformers' Auto classes costs ~0.3 s of every cold start, GGUF ones too.
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as error:  # transformers raises many types (strict dataclass checks among them)
        raise ValueError(f"model: cannot read {config_file}: {error}") from error
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    safetensor_files = sorted(path.glob("*.safetensors"))
    if safetensor_files:
        shapes = _safetensors_shapes(safetensor_files)
        stream = lambda: _stream_safetensors(safetensor_files, progress)  # noqa: E731
        return LoadedCheckpoint(config, tokenizer, str(path), weight_stream=stream, weight_shapes=shapes, dtype=dtype)
    pickled_files = _pickled_files(path, allow_pickle)
    return LoadedCheckpoint(config, tokenizer, str(path), weight_stream=lambda: _stream_pickled(pickled_files, progress),
                            dtype=dtype)


def _safetensors_shapes(files: list[Path]) -> WeightShapes:
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    shapes[name] = (tuple(reader.get_slice(name).get_shape()), str(file))
        except Exception as error:  # safetensors raises its own types for corrupt headers
            raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error
    return shapes


def _stream_safetensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for file in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        try:
            reader_context = safe_open(file, framework="pt")
            reader = reader_context.__enter__()
        except Exception as error:
            raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error
        try:
            for name in reader.keys():
                try:
                    tensor = reader.get_tensor(name)
                except Exception as error:  # a tensor past the end of a truncated file
                    raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error
                yield name, tensor
                del tensor
        finally:
            reader_context.__exit__(None, None, None)


def _pickled_files(path: Path, allow_pickle: bool) -> list[Path]:
    pickled_files = sorted(path.glob("*.bin"))
    if not pickled_files:
        raise ValueError(f"model: {str(path)!r} has no *.safetensors weights")
    if not allow_pickle:
        raise ValueError(
            f"model: {str(path)!r} has only pickled .bin weights; pass allow_pickle=True to load them "
            "(they are then read with torch.load(weights_only=True))"
        )
    return pickled_files


def _stream_pickled(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for file in tqdm(files, desc="Loading weights", disable=not progress):
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:
            raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error
        yield from state.items()
        del state
