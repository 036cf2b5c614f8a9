"""Peak resident memory while loading a ~1B-parameter bf16 safetensors checkpoint, against the
model's final size (the streamed-loading goal: peak ≤ 1.25× the loaded tensors).

    python -m hearth_llm.benchmarks.load_memory make /tmp/llama1b     # random weights, 6 shards
    python -m hearth_llm.benchmarks.load_memory measure /tmp/llama1b  # a fresh process per run

``measure`` builds ``LLM(dir, dtype="bfloat16")`` in this process and reads ``VmHWM`` (peak) and
``VmRSS`` from ``/proc/self/status``; "model" is the bytes of every tensor the loaded model holds
(parameters, buffers, packed CPU copies).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# TinyLlama-1.1B's shape: 1.1 B parameters, 2.2 GB in bf16.
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
LAYERS_PER_SHARD = 4


def status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _layer_weights(layer: int, randn) -> dict[str, torch.Tensor]:
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = SHAPE["num_key_value_heads"] * hidden // SHAPE["num_attention_heads"]
    prefix = f"model.layers.{layer}."
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    weights = {f"{prefix}{name}.weight": randn(*shape) for name, shape in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        weights[f"{prefix}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return weights


def make(path: Path) -> None:
    """Write the checkpoint shard by shard (never more than one shard in memory), with a word-level tokenizer."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**SHAPE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                eos_token_id=2, pad_token_id=0, dtype="bfloat16").save_pretrained(path)
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(320)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                            unk_token="w3").save_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: (torch.randn(*shape, generator=generator) * 0.02).bfloat16()  # noqa: E731
    hidden, vocab = SHAPE["hidden_size"], SHAPE["vocab_size"]
    shards = [lambda: {"model.embed_tokens.weight": randn(vocab, hidden), "lm_head.weight": randn(vocab, hidden),
                       "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}]
    for first in range(0, SHAPE["num_hidden_layers"], LAYERS_PER_SHARD):
        layers = range(first, min(first + LAYERS_PER_SHARD, SHAPE["num_hidden_layers"]))
        shards.append(lambda layers=layers: {k: v for i in layers for k, v in _layer_weights(i, randn).items()})
    weight_map = {}
    for index, make_shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = make_shard()
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    print(f"wrote {path}")


def _model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    for module in model.modules():  # packed CPU copies are plain attributes (tensors, tuples, lists)
        for value in vars(module).values():
            values = value if isinstance(value, (tuple, list)) else (value,)
            tensors.update({id(v): v for v in values if isinstance(v, torch.Tensor)})
    return sum(_nbytes(t) for t in tensors.values())


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except NotImplementedError:  # oneDNN-packed weights have no plain storage
        return tensor.numel() * tensor.element_size()


def measure(path: Path) -> dict:
    from hearth_llm.engine import LLM

    baseline_kib = status_kib("VmRSS")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=64 << 20, show_progress=False)
    peak_kib, after_kib = status_kib("VmHWM"), status_kib("VmRSS")
    model_bytes = _model_bytes(llm.engine.runner.model)
    llm.close()
    gib = 2**20
    result = dict(baseline_rss_gib=round(baseline_kib / gib, 3), peak_rss_gib=round(peak_kib / gib, 3),
                  rss_after_load_gib=round(after_kib / gib, 3), model_tensors_gib=round(model_bytes / 2**30, 3),
                  peak_over_model=round((peak_kib - baseline_kib) * 1024 / model_bytes, 3),
                  rss_after_over_model=round((after_kib - baseline_kib) * 1024 / model_bytes, 3))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "measure"):
        sys.exit(__doc__)
    {"make": make, "measure": measure}[sys.argv[1]](Path(sys.argv[2]))
