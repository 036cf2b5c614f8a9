"""Load a Hugging Face model directory: config.json, tokenizer files and (sharded) safetensors."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint import LoadedCheckpoint


def load_hf_dir(path: str | Path, dtype: torch.dtype, allow_pickle: bool = False, progress: bool = True) -> LoadedCheckpoint:
    """Load ``path`` (a directory with config.json). Pickled ``.bin`` weights need ``allow_pickle=True``."""
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
    state_dict = _read_weights(path, dtype, allow_pickle, progress)
    return LoadedCheckpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, source=str(path))


def _read_weights(path: Path, dtype: torch.dtype, allow_pickle: bool, progress: bool) -> dict[str, torch.Tensor]:
    safetensor_files = sorted(path.glob("*.safetensors"))
    if safetensor_files:
        return _read_safetensors(safetensor_files, dtype, progress)
    pickled_files = sorted(path.glob("*.bin"))
    if not pickled_files:
        raise ValueError(f"model: {str(path)!r} has no *.safetensors weights")
    if not allow_pickle:
        raise ValueError(
            f"model: {str(path)!r} has only pickled .bin weights; pass allow_pickle=True to load them "
            "(they are then read with torch.load(weights_only=True))"
        )
    state_dict = {}
    for file in tqdm(pickled_files, desc="Loading weights", disable=not progress):
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
            state_dict[name] = tensor.to(dtype)
    return state_dict


def _read_safetensors(files: list[Path], dtype: torch.dtype, progress: bool) -> dict[str, torch.Tensor]:
    state_dict = {}
    with tqdm(total=len(files), desc="Loading weights", unit="file", disable=not progress) as bar:
        for file in files:
            try:
                with safe_open(file, framework="pt") as reader:
                    for name in reader.keys():
                        state_dict[name] = reader.get_tensor(name).to(dtype)
            except Exception as error:  # safetensors raises its own types for corrupt headers
                raise ValueError(f"model: cannot read weights file {str(file)!r}: {error}") from error
            bar.update()
    return state_dict
