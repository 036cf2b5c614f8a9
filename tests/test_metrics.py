"""Prometheus metrics under vLLM's names, served on loopback."""
import socket
import urllib.request

from prometheus_client import REGISTRY

from hearth_llm.engine import SamplingParams
from hearth_llm.engine.metrics import start_metrics_server

from conftest import random_prompts


def sample(name, model):
    return REGISTRY.get_sample_value(name, {"model_name": str(model)}) or 0.0


def test_counters_and_histograms_follow_the_engine(tiny_model_dirs, make_llm):
    path = tiny_model_dirs["llama"]
    llm = make_llm(path, block_size=4)
    before_tokens = sample("vllm:generation_tokens_total", path)
    before_ttft = sample("vllm:time_to_first_token_seconds_count", path)
    prompt = random_prompts(1, [12])[0]
    for _ in range(2):  # the second run hits the prefix cache
        llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert sample("vllm:generation_tokens_total", path) - before_tokens == 10
    assert sample("vllm:time_to_first_token_seconds_count", path) - before_ttft == 2
    assert sample("vllm:e2e_request_latency_seconds_count", path) >= 2
    assert sample("vllm:prefix_cache_hits_total", path) >= 8
    assert sample("vllm:num_requests_running", path) == 0


def test_metrics_server_binds_loopback():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start_metrics_server(port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "vllm:num_requests_waiting" in body and "vllm:kv_cache_usage_perc" in body
