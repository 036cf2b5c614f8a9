"""Tensor parallelism (two gloo ranks on the CPU, fp32) for every dense family the other
tests/test_tensor_parallel*.py files do not cover: greedy tokens at TP=2 equal HF transformers.

The tiny configs are the families' own single-process test configs. OLMo 2 (q/k RMSNorm over
all heads: one all-reduce of the sums of squares) and Command-R+ (per-head q/k LayerNorm: each
rank scales by its heads' rows) also run with ONE key/value head, which both ranks replicate.
One engine per family, two short prompts: the worker start-up dominates this file's time.
"""
from __future__ import annotations

import pytest
from transformers import Phi3Config

from hearth_llm.engine import LLM

import test_models_gemma_phi as gemma_phi
import test_models_olmo_granite_cohere_starcoder as olmo_granite_cohere_starcoder
import test_models_smollm3_glm4_ministral as smollm3_glm4_ministral
from conftest import TINY_COMMON, random_prompts
from model_equality import GREEDY, assert_matches_hf, save_tiny_model


def _one_kv_head(make):
    def build():
        config = make()
        config.num_key_value_heads = 1  # fewer than the ranks: each rank keeps a copy
        return config
    return build


_OGCS, _SGM = olmo_granite_cohere_starcoder.CONFIGS, smollm3_glm4_ministral.CONFIGS
CONFIGS = {
    **{name: (lambda cls=cls, kw=kw: cls(**kw)) for name, (cls, kw) in gemma_phi.CONFIGS.items()
       if name in ("gemma", "gemma2", "gemma3")},
    "phi3": lambda: Phi3Config(**TINY_COMMON, sliding_window=12, partial_rotary_factor=0.75,
                               architectures=["Phi3ForCausalLM"]),
    **{name: _OGCS[name] for name in ("granite-bias", "cohere", "cohere-qk-norm", "starcoder2", "olmo2",
                                      "olmo2-bias")},
    "olmo2-one-kv-head": _one_kv_head(_OGCS["olmo2"]),
    "cohere-qk-norm-one-kv-head": _one_kv_head(_OGCS["cohere-qk-norm"]),
    **{name: _SGM[name] for name in ("smollm3", "glm4", "ministral")},
}
CPU = dict(device="cpu", dtype="float32", show_progress=False, block_size=8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_matches_hf(tmp_path, name):
    path = save_tiny_model(CONFIGS[name](), tmp_path / name, seed=len(name))
    prompts = random_prompts(2, [3, 21], seed=41)
    with LLM(str(path), tensor_parallel_size=2, **CPU) as llm:
        assert_matches_hf(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
