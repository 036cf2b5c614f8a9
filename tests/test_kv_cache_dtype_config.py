"""``EngineConfig.kv_cache_dtype``: its values, and honest refusals where the fp8 cache does not run."""
import pytest
import torch

from hearth_llm.engine.config import EngineConfig


def test_auto_stores_the_model_dtype():
    assert EngineConfig(device="cpu", dtype="float32").kv_cache_torch_dtype == torch.float32


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(device="cpu", kv_cache_dtype="int8")


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_is_refused_on_the_cpu(value):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{value}' needs CUDA"):
        EngineConfig(device="cpu", kv_cache_dtype=value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kv_cache_on_cuda_stores_e4m3_and_refuses_tensor_parallelism():
    assert EngineConfig(device="cuda", kv_cache_dtype="fp8").kv_cache_torch_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported with tensor_parallel_size=2"):
        EngineConfig(device="cuda", kv_cache_dtype="fp8", tensor_parallel_size=2)
