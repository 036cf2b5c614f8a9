"""GGUF files for the CPU GGUF benchmark: a random-weight Llama of a given shape written as f16 with the
``gguf`` package's writer, then quantized by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``,
run in llama-cpp-python's interpreter), so the Q4_K_M / Q8_0 bytes are exactly what users download.

>>> path = quantized_llama(LLAMA_1B, "Q4_K_M", work_dir, llama_cpp_python="/tmp/llamacpp-venv/bin/python")

Files are cached in ``work_dir`` under a name that carries the shape and the type, so a second run reads
them instead of writing 2 GB again.
"""
from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaShape:
    """The few fields a Llama GGUF needs; ``num_parameters`` counts every tensor (untied output)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int

    @property
    def name(self) -> str:
        return "llama-h{hidden_size}-l{num_layers}-i{intermediate_size}-v{vocab_size}".format(**asdict(self))

    @property
    def num_parameters(self) -> int:
        head_dim = self.hidden_size // self.num_heads
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * self.num_kv_heads * head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size


# Llama-3.2-1B's body with a 32k vocabulary: 1.08 B parameters.
LLAMA_1B = LlamaShape(hidden_size=2048, num_layers=16, intermediate_size=8192, num_heads=32, num_kv_heads=8,
                      vocab_size=32000)
# llama.cpp's names for the file types the benchmark asks for (llama.h's LLAMA_FTYPE_MOSTLY_*).
FILE_TYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
              "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}

_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def quantized_llama(shape: LlamaShape, quant_type: str, work_dir: Path, llama_cpp_python: str,
                    num_threads: int = 2) -> Path:
    """The cached ``quant_type`` file of a random ``shape`` Llama, made by llama.cpp's quantizer from
    the f16 file (both written on first use)."""
    if quant_type not in FILE_TYPES:
        raise ValueError(f"quant_type must be one of {sorted(FILE_TYPES)}, got {quant_type!r}")
    path = Path(work_dir) / f"{shape.name}.{quant_type}.gguf"
    if path.exists():
        return path
    source = f16_llama(shape, work_dir)
    partial = path.with_suffix(".partial")
    subprocess.run([llama_cpp_python, "-c", _QUANTIZE, str(source), str(partial), FILE_TYPES[quant_type],
                    str(num_threads)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial.rename(path)  # only a finished file gets the cached name
    return path


def f16_llama(shape: LlamaShape, work_dir: Path, seed: int = 0) -> Path:
    """A random-weight Llama of ``shape`` (normal, std 0.02; norms 1) as an f16 GGUF, cached."""
    import gguf
    import numpy as np

    path = Path(work_dir) / f"{shape.name}.F16.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    _write_hyperparameters(writer, shape)
    _write_byte_vocabulary(writer, shape.vocab_size)
    rng = np.random.default_rng(seed)
    for name, rows_columns in _tensor_shapes(shape):
        if len(rows_columns) == 1:  # norms stay f32, as llama.cpp's converter writes them
            writer.add_tensor(name, np.ones(rows_columns, dtype=np.float32))
        else:
            weights = rng.standard_normal(rows_columns, dtype=np.float32) * np.float32(0.02)
            writer.add_tensor(name, weights.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def _write_hyperparameters(writer, shape: LlamaShape) -> None:
    import gguf

    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.num_layers)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_rope_dimension_count(shape.hidden_size // shape.num_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _write_byte_vocabulary(writer, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens (the benchmark feeds token ids, so only
    its size matters; both engines read the same one)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<pad>", "<s>", "</s>", *bytes_to_unicode().values(), "he"]
    tokens += [f"tok{i}" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensor_shapes(shape: LlamaShape):
    """(llama.cpp tensor name, numpy shape [rows, columns]) in the converter's order."""
    hidden, kv = shape.hidden_size, shape.num_kv_heads * (shape.hidden_size // shape.num_heads)
    yield "token_embd.weight", (shape.vocab_size, hidden)
    for layer in range(shape.num_layers):
        block = f"blk.{layer}"
        yield f"{block}.attn_norm.weight", (hidden,)
        yield f"{block}.attn_q.weight", (hidden, hidden)
        yield f"{block}.attn_k.weight", (kv, hidden)
        yield f"{block}.attn_v.weight", (kv, hidden)
        yield f"{block}.attn_output.weight", (hidden, hidden)
        yield f"{block}.ffn_norm.weight", (hidden,)
        yield f"{block}.ffn_gate.weight", (shape.intermediate_size, hidden)
        yield f"{block}.ffn_up.weight", (shape.intermediate_size, hidden)
        yield f"{block}.ffn_down.weight", (hidden, shape.intermediate_size)
    yield "output_norm.weight", (hidden,)
    yield "output.weight", (shape.vocab_size, hidden)
