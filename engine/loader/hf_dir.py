"""Open a Hugging Face model directory: config.json, tokenizer files and (sharded) safetensors.

Opening reads the config, the tokenizer and the safetensors headers (names, shapes), not the
weights: they stream out of :meth:`LoadedCheckpoint.weights`, one file open at a time.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint import LoadedCheckpoint, WeightShapes
from .config_cache import load_config
from .staged_reads import ReadStats, TensorEntry, stream_to_device

logger = logging.getLogger("hearth_llm.loader")


def load_hf_dir(path: str | Path, dtype: torch.dtype, allow_pickle: bool = False, progress: bool = True) -> LoadedCheckpoint:
    """Open ``path`` (a directory with config.json). Pickled ``.bin`` weights need ``allow_pickle=True``.

    >>> checkpoint = load_hf_dir("models/tiny-llama", torch.float32)
    >>> checkpoint.weight_shapes()["lm_head.weight"]
    ((320, 64), 'models/tiny-llama/model.safetensors')
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json")
    try:
        config = load_config(config_file)  # remembered across processes: config_cache.py
    except Exception as error:  # transformers raises many types (strict dataclass checks among them)
        raise ValueError(f"model: cannot read {config_file}: {error}") from error
    tokenizer = _load_tokenizer(path)
    safetensor_files = sorted(path.glob("*.safetensors"))
    if safetensor_files:
        shapes = _safetensors_shapes(safetensor_files)
        stream = lambda: _stream_safetensors(safetensor_files, progress)  # noqa: E731
        to_device = lambda device: _stream_safetensors_to_device(safetensor_files, device)  # noqa: E731
        return LoadedCheckpoint(config, tokenizer, str(path), weight_stream=stream, weight_shapes=shapes, dtype=dtype,
                                device_weight_stream=to_device)
    pickled_files = _pickled_files(path, allow_pickle)
    return LoadedCheckpoint(config, tokenizer, str(path), weight_stream=lambda: _stream_pickled(pickled_files, progress),
                            dtype=dtype)


# Tokenizer classes of transformers' top level: loaded by the class itself, AutoTokenizer would pick it
# the same way but first imports transformers.models' index of every model (~1.4 s of a cold start).
_TOP_LEVEL_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _load_tokenizer(path: Path):
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in _TOP_LEVEL_TOKENIZERS and hasattr(transformers, name):
        return getattr(transformers, name).from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)


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
    """Each tensor read with plain file reads into memory of its own.

    Not through safetensors' memory map: the mapped pages of a whole shard would count towards the
    process's resident memory until the file closes, on top of the model being filled in.
    """
    for file in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        try:
            with open(file, "rb") as reader:
                for name, (dtype, shape, start, end) in _safetensors_entries(reader).items():
                    buffer = torch.empty(end - start, dtype=torch.uint8)
                    reader.seek(start)
                    if reader.readinto(memoryview(buffer.numpy())) != end - start:
                        raise ValueError(f"tensor {name!r} runs past the end of the file")
                    yield name, buffer.view(dtype).reshape(shape)
                    del buffer
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
            raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error


def _stream_safetensors_to_device(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor already on ``device`` (a CUDA one), read through pinned buffers by reader threads
    (``staged_reads.py``), each file's tensors in file order; how long it took is logged."""
    stats = ReadStats()
    try:
        entries = []
        for file in files:
            with open(file, "rb") as reader:
                header = _safetensors_entries(reader)
            entries += sorted((TensorEntry(name, str(file), dtype, tuple(shape), start, end)
                               for name, (dtype, shape, start, end) in header.items()), key=lambda e: e.start)
        yield from stream_to_device(entries, device, stats=stats)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise ValueError(f"model: cannot read the weights files of {str(files[0].parent)!r}: {error}") from error
    logger.info("weights: %.2f GB in %d tensors read to %s in %.2f s (%.2f s waiting for reads, %.2f s in the "
                "weight loaders)", stats.num_bytes / 1e9, stats.num_tensors, device, stats.seconds,
                stats.seconds_waiting_for_reads, stats.seconds_in_consumer)


# safetensors dtype names -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _safetensors_entries(reader) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """``name -> (dtype, shape, first byte, end byte)`` from a safetensors header (already
    validated by ``safe_open`` when the checkpoint was opened)."""
    header_size = int.from_bytes(reader.read(8), "little")
    header = json.loads(reader.read(header_size))
    data_start = 8 + header_size
    return {name: (_SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], data_start + entry["data_offsets"][0],
                   data_start + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


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
