"""In-process text embeddings: sentence-transformers models on a background engine that batches
every caller's texts together.

>>> from hearth_llm.embeddings import get_embedding_engine
>>> engine = get_embedding_engine()                    # all-MiniLM-L6-v2, bundled
>>> engine.embed(["The cat sat on the mat.", "Paris is in France."]).shape
torch.Size([2, 384])
>>> e5 = get_embedding_engine("/models/multilingual-e5-small", dimensions=256)   # prompts from its config
>>> e5.embed(["Where is Paris?"], prompt_name="query").shape
torch.Size([1, 256])
>>> reranker = get_embedding_engine("/models/bge-reranker-v2-m3")                 # a cross-encoder
>>> reranker.score("Where is Paris?", ["Paris is in France.", "Rome is in Italy."])
>>> qwen = get_embedding_engine("/models/Qwen3-Embedding-0.6B", dimensions=512)    # a decoder, last token
>>> qwen.embed(["Where is Paris?"], prompt_name="query").shape
torch.Size([1, 512])
>>> llm_reranker = get_embedding_engine("/models/Qwen3-Reranker-0.6B", task="score")   # P("yes")
"""
from .config import EmbeddingConfig
from .engine import EmbeddingEngine
from .errors import (EmbeddingEngineClosedError, EmbeddingEngineDeadError, EmbeddingError, EmbeddingFailedError,
                     TextTooLongError)
from .model_dir import EncoderSpec, default_model_path, read_encoder_spec
from .registry import get_embedding_engine, shutdown_embedding_engines

__all__ = ["EmbeddingEngine", "EmbeddingConfig", "get_embedding_engine", "shutdown_embedding_engines",
           "EncoderSpec", "read_encoder_spec", "default_model_path", "EmbeddingError", "EmbeddingEngineDeadError",
           "EmbeddingEngineClosedError", "EmbeddingFailedError", "TextTooLongError"]
