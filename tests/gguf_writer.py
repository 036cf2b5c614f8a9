"""Tiny GGUF files written as llama.cpp's converter writes them, shared by each family's GGUF
loader tests: the shape fields every architecture has, a byte-level BPE vocabulary of the tiny
models' size, and the tensors under gguf's own name map.

>>> writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.OLMO2])
>>> write_shape_fields(writer, config); write_tiny_tokenizer(writer)
>>> write_tensors_and_close(writer, load_file(hf_dir / "model.safetensors"), gguf.MODEL_ARCH.OLMO2, config)
"""
from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from conftest import TINY_VOCAB


def write_shape_fields(writer: gguf.GGUFWriter, config: dict) -> None:
    """The hyperparameters every decoder GGUF carries (an architecture's own keys come on top)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_vocab_size(config["vocab_size"])


def write_tiny_tokenizer(writer: gguf.GGUFWriter, special_tokens=("<pad>", "<bos>", "<eos>")) -> None:
    """A byte-level BPE vocabulary of exactly the tiny models' size (ids are what the tests feed)."""
    tokens = [*special_tokens, *bytes_to_unicode().values(), "he"]
    tokens += [f"tok{i}" for i in range(TINY_VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tensors_and_close(writer: gguf.GGUFWriter, tensors: dict[str, torch.Tensor], architecture, config: dict,
                            transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Every HF tensor under its llama.cpp name (``transform`` first, as a converter rewrites some),
    then the file written and closed."""
    name_map = gguf.get_tensor_name_map(architecture, config["num_hidden_layers"])
    for hf_name, tensor in tensors.items():
        if transform is not None:
            tensor = transform(hf_name, tensor)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, tensor.float().numpy())
    write_and_close(writer)


def write_and_close(writer: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors to the file, then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_q8_0_embedding_and_norm(writer: gguf.GGUFWriter, vocab: int, hidden: int) -> np.ndarray:
    """A random token embedding as Q8_0 blocks (seed 0; tied to the head when no ``output.weight``
    follows) and an all-ones final norm; returns the embedding's blocks."""
    from hearth_llm.kernels.quant import gguf_reference

    generator = torch.Generator().manual_seed(0)
    embedding = gguf_reference.quantize(torch.randn(vocab, hidden, generator=generator), "Q8_0").numpy()
    writer.add_tensor("token_embd.weight", embedding, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    return embedding


# A Llama layer's linear tensors under llama.cpp's names, in (q, k, v, o, gate, up, down) order.
LLAMA_LINEAR_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tiny_llama_writer(path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> gguf.GGUFWriter:
    """A writer for a tiny Llama GGUF with its shape fields, rope base, norm epsilon and the tiny
    tokenizer written; the tensors come next.

    >>> writer = tiny_llama_writer(path, 256, 512, 2, 4, 2)
    """
    writer = gguf.GGUFWriter(path, "llama")
    write_shape_fields(writer, dict(max_position_embeddings=256, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, vocab_size=TINY_VOCAB))
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    write_tiny_tokenizer(writer)
    return writer


def add_block_layers(writer: gguf.GGUFWriter, layer_types, hidden: int,
                     blocks_of: Callable[[str, str, int], np.ndarray]) -> dict[str, int]:
    """Each layer's two norms (ones) and its linears in the block types ``layer_types[layer]`` (one per
    ``LLAMA_LINEAR_NAMES`` entry), ``blocks_of(quant_type, name, seed)`` making each tensor's blocks;
    returns the bytes of each linear tensor by ``"blk.{layer}.{name}"``."""
    tensor_bytes = {}
    for layer, types in enumerate(layer_types):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for index, (name, quant_type) in enumerate(zip(LLAMA_LINEAR_NAMES, types)):
            blocks = blocks_of(quant_type, name, 10 * layer + index)
            tensor_bytes[f"blk.{layer}.{name}"] = blocks.nbytes
            writer.add_tensor(f"blk.{layer}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[quant_type])
    return tensor_bytes
