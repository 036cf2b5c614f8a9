"""A random-weight safetensors directory of a benchmark shape, written fast: what a hub download leaves.

``config.json``, a word-level tokenizer over the whole vocabulary, and ``model-0000K-of-0000N.safetensors``
shards of at most ~5 GB with their ``model.safetensors.index.json``, under the hub's names. The bytes
are a 64 MiB block of ``normal(0, 0.02)`` values repeated (norm weights 1, biases 0): no 16 GB random
draw, yet every byte is really written, so reading it back costs what reading a real checkpoint from
the page cache costs. Shards are written by one thread each.

>>> write_random_checkpoint("tiny-qwen3", "/tmp/tiny-qwen3")  # doctest: +SKIP
2795520
"""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SHARD_BYTES = 5 * 10**9
_PATTERN_BYTES = 64 << 20
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_random_checkpoint(shape: str, directory: str | Path, dtype: str = "bfloat16",
                            shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``shape`` with random weights to ``directory`` (its old ``*.safetensors`` removed);
    returns the weight bytes written."""
    from .random_weights import checkpoint_shapes
    from .throughput import hf_config, placeholder_tokenizer

    torch_dtype = getattr(torch, dtype, None)
    if torch_dtype not in _SAFETENSORS_NAMES:
        raise ValueError(f"dtype {dtype!r}: one of {[str(d).removeprefix('torch.') for d in _SAFETENSORS_NAMES]}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    config = hf_config(shape)
    config.dtype = dtype
    config.save_pretrained(directory)
    placeholder_tokenizer(config.vocab_size).save_pretrained(directory)
    shapes = checkpoint_shapes(config, torch_dtype)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    shards = _split_into_shards(shapes, element_size, shard_bytes)
    pattern = (torch.randn(_PATTERN_BYTES // element_size, generator=torch.Generator().manual_seed(0)) * 0.02)
    pattern_bytes = memoryview(pattern.to(torch_dtype).view(torch.uint8).numpy())
    names = [f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors" for index in range(len(shards))]
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        sizes = list(pool.map(lambda job: _write_shard(directory / job[0], job[1], torch_dtype, pattern_bytes),
                              zip(names, shards)))
    weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(sizes)


def _split_into_shards(shapes: dict[str, tuple[int, ...]], element_size: int, shard_bytes: int) -> list[dict]:
    shards: list[dict] = [{}]
    size = 0
    for name, shape in shapes.items():
        num_bytes = math.prod(shape) * element_size
        if shards[-1] and size + num_bytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += num_bytes
    return shards


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, pattern: memoryview) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        num_bytes = math.prod(shape) * element_size
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb", buffering=0) as sink:
        sink.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            num_bytes = math.prod(shape) * element_size
            if name.rpartition(".")[0].endswith("norm") or name.endswith(".bias"):
                value = torch.ones if not name.endswith(".bias") else torch.zeros
                sink.write(value(shape, dtype=dtype).view(torch.uint8).numpy().tobytes())
                continue
            written = 0
            while written < num_bytes:
                written += sink.write(pattern[:min(len(pattern), num_bytes - written)])
    return offset
