"""``POST /v1/embeddings``: texts onto the shared embedding engine, vectors back as floats or as
base64 of little-endian float32 (what the ``openai`` client asks for by default)."""
from __future__ import annotations

import asyncio
import base64
import functools

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from hearth_llm.embeddings import EmbeddingEngine

from .errors import APIError, engine_failure, invalid_parameter
from .protocol import EmbeddingRequest
from .state import ServerState

_FIELDS = frozenset(EmbeddingRequest.model_fields) | {"texts"}


async def create_embeddings(body: EmbeddingRequest, request: Request):
    state: ServerState = request.app.state.hearth
    engine = state.check_embedding_model(body.model)
    texts = _texts(body.input)
    if body.dimensions is not None and body.dimensions != engine.dimension:
        raise APIError(400, f"dimensions: this model's embeddings have {engine.dimension} dimensions and cannot be "
                            f"shortened; leave dimensions out or send {engine.dimension}", param="dimensions")
    request.state.log.update(model=body.model, user=body.user, num_texts=len(texts))
    timeout = state.timeout(request)
    await state.admit(request, uses_chat_engine=False)
    try:
        vectors = await asyncio.wait_for(engine.aembed(texts), timeout)  # cancelled: its texts are dropped
    except TimeoutError:
        raise APIError(504, f"embedding {len(texts)} texts did not finish within {timeout} s",
                       code="request_timeout") from None
    except (ValueError, TypeError) as error:
        raise invalid_parameter(error, _FIELDS) from error
    except Exception as error:
        raise engine_failure(error) or error
    num_tokens = await asyncio.to_thread(_count_tokens, engine, texts)
    state.charge(request, num_tokens)
    encode = _base64 if body.encoding_format == "base64" else _floats
    data = [{"object": "embedding", "index": index, "embedding": encode(vector)}
            for index, vector in enumerate(vectors.numpy())]
    return JSONResponse({"object": "list", "data": data, "model": state.settings.embedding_model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _texts(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty", param="input")
    if not all(isinstance(item, str) for item in value):
        raise APIError(400, "input: token ids are not supported here (they would be another tokenizer's); "
                            "send text", param="input")
    return list(value)


def _floats(vector: np.ndarray) -> list[float]:
    return vector.astype(np.float32).tolist()


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def _count_tokens(engine: EmbeddingEngine, texts: list[str]) -> int:
    """The tokens the model read, special tokens included, as its engine truncates them (for ``usage``)."""
    spec = engine.spec
    tokenizer = _tokenizer(str(spec.encoder_path))
    texts = [text.lower() for text in texts] if spec.do_lower_case else texts
    encoded = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=spec.max_seq_length)
    return sum(len(ids) for ids in encoded["input_ids"])


@functools.cache
def _tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)
