"""Where the embedding engine's GPU time goes on the passages workload (``bench embeddings
--passages --breakdown``): host tokenizing, the device alone, the GEMMs alone, each op of one batch
timed by itself, and a profile of one batch's kernels by kind.

- ``host_tokenize_seconds``: the engine's tokenizer on every passage, in the engine's step size.
- ``device_only``: the batches the engine forms, launched back to back from one thread (no engine
  thread, no futures); against the engine's own rate it says what the engine's host side costs.
- ``gemm_only``: just the model's dense layers (``F.linear`` with bias, the real weights) on every
  batch's tokens: no attention, norms, GELU or host work. It bounds the bf16 speed from above, so
  ``ceiling_speedup`` (its passages/s over sentence-transformers') is what no fusion can beat
  without faster matmuls. Back to back the GPU clocks down under them (617 TFLOP/s on the H200,
  736 inside the forward pass), so ``ceiling_speedup_in_forward`` scales the profiled batch's GEMM
  time instead: the looser bound.
- ``ops_us``: each op of one layer on the largest batch, timed alone with CUDA events over the 24
  layers' weights in turn (so they cycle through L2 as in a forward pass), with alternatives where
  the forward pass could take another kernel.
- ``profile``: the device time of one batch's kernels summed by kind (GEMM, attention, norm, GELU,
  other elementwise, copies), from ``torch.profiler``.

>>> passages_breakdown(engine, passages, st_passages_per_s=2450.0)
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hearth_llm.embeddings import bert
from hearth_llm.embeddings.batching import plan_batches
from hearth_llm.embeddings.bert import PackedLayout, packed_attention

BATCH_TOKENS_SWEEP = (4096, 8192, 16384, 32768)
BATCH_TOKENS_SWEEP_PASSAGES = 3000
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),     # flash names cutlass types
                ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
                ("norm", ("norm",)), ("gelu", ("gelu",)),
                ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat")),
                ("elementwise", ("elementwise", "add", "mul", "vectorized", "reduce", "embedding", "fill")))


def passages_breakdown(engine, passages: list[str], st_passages_per_s: float | None) -> dict:
    """The breakdown of the module docstring for ``engine`` (started, on CUDA) on ``passages``."""
    runner = engine._loaded_runner()     # the bench looks inside: its tokenizer, model and batches
    result: dict = {}
    step = engine.config.batch_size_limit
    start = time.perf_counter()
    token_ids: list[list[int]] = []
    for first in range(0, len(passages), step):
        token_ids += runner.tokenize(passages[first:first + step], truncate=True)[0]
    result["host_tokenize_seconds"] = round(time.perf_counter() - start, 3)
    lengths = [len(ids) for ids in token_ids]
    batches = [[token_ids[i] for i in batch]
               for batch in plan_batches(lengths, engine.config.batch_token_budget, engine.config.batch_size_limit)]
    result["num_batches"], result["num_tokens"] = len(batches), sum(lengths)
    with torch.inference_mode():
        seconds = _wall(lambda: [pending.wait() for pending in [runner.launch(batch) for batch in batches]])
        result["device_only_passages_per_s"] = round(len(passages) / seconds, 1)
        result["device_only_by_batch_tokens"] = _device_only_by_batch_tokens(
            runner, token_ids[:BATCH_TOKENS_SWEEP_PASSAGES], engine.config.batch_size_limit)
        gemm_seconds = _gemm_only_seconds(runner.model, [sum(map(len, batch)) for batch in batches])
        result["gemm_only_passages_per_s"] = round(len(passages) / gemm_seconds, 1)
        flops = 2 * sum(lengths) * sum(w.numel() for w in _dense_weights(runner.model))
        result["gemm_only_tflops"] = round(flops / gemm_seconds / 1e12, 1)
        result["gemm_share_of_device_only"] = round(gemm_seconds / seconds, 3)
        if st_passages_per_s:
            result["ceiling_speedup"] = round(len(passages) / gemm_seconds / st_passages_per_s, 2)
        result["ops_us"] = _ops_us(runner.model, batches[0], runner.device)
        result["forward_us"] = _forward_us(runner, batches[0])
        try:
            result["profile"] = _profile(runner, batches[0])
        except RuntimeError as error:     # no CUPTI on this machine...
            result["profile"] = f"failed: {type(error).__name__}: {str(error)[:200]}"
        else:
            # The GEMMs at the rate they run inside the forward pass (the back-to-back rate above
            # is lower: the GPU clocks down under GEMMs alone), scaled from one batch to all tokens.
            gemm_us = result["profile"]["kernel_us_by_kind"].get("gemm", 0.0)
            if gemm_us:
                seconds = gemm_us * 1e-6 * sum(lengths) / sum(map(len, batches[0]))
                result["gemm_in_forward_passages_per_s"] = round(len(passages) / seconds, 1)
                if st_passages_per_s:
                    result["ceiling_speedup_in_forward"] = round(len(passages) / seconds / st_passages_per_s, 2)
    return result


def _device_only_by_batch_tokens(runner, token_ids: list[list[int]], max_batch_size: int) -> dict:
    """Passages per second of the device alone with each of BATCH_TOKENS_SWEEP as the batch budget
    (smaller batches keep more of a layer's activations in L2; larger ones run larger GEMMs)."""
    lengths = [len(ids) for ids in token_ids]
    rates = {}
    for budget in BATCH_TOKENS_SWEEP:
        batches = [[token_ids[i] for i in batch] for batch in plan_batches(lengths, budget, max_batch_size)]
        [pending.wait() for pending in [runner.launch(batch) for batch in batches[:2]]]     # new shapes: warm
        seconds = _wall(lambda: [pending.wait() for pending in [runner.launch(batch) for batch in batches]])
        rates[budget] = round(len(token_ids) / seconds, 1)
    return rates


def _dense_weights(model) -> list[torch.Tensor]:
    return [linear.weight for layer in model.layers
            for linear in (layer.qkv_proj, layer.out_proj, layer.up_proj, layer.down_proj)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wall(run) -> float:
    _sync()
    start = time.perf_counter()
    run()
    _sync()
    return time.perf_counter() - start


def _cuda_us(run, repeats: int) -> float:
    """Microseconds per call of ``run(i)`` for i in range(repeats), after one warm-up call (CUDA
    events on a GPU; the wall clock in a CPU dry run)."""
    run(0)
    if not torch.cuda.is_available():
        return round(_wall(lambda: [run(i) for i in range(repeats)]) * 1e6 / repeats, 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(repeats):
        run(i)
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1000 / repeats, 1)


def _gemm_only_seconds(model, batch_tokens: list[int]) -> float:
    width = model.config.hidden_size
    weight = model.word_embeddings.weight
    x = torch.randn(max(batch_tokens), width, device=weight.device, dtype=weight.dtype)
    up = torch.randn(max(batch_tokens), model.config.intermediate_size, device=weight.device, dtype=weight.dtype)

    def run() -> None:
        for tokens in batch_tokens:
            for layer in model.layers:
                for linear, inputs in ((layer.qkv_proj, x), (layer.out_proj, x), (layer.up_proj, x),
                                       (layer.down_proj, up)):
                    F.linear(inputs[:tokens], linear.weight, linear.bias)

    run()
    return _wall(run)


def _ops_us(model, batch: list[list[int]], device: torch.device) -> dict:
    """Each op of a layer on ``batch`` (the largest), alone; alternatives beside the kernel we run."""
    layers, config = model.layers, model.config
    num_layers, tokens, width = len(layers), sum(map(len, batch)), config.hidden_size
    dtype = model.word_embeddings.weight.dtype
    x = torch.randn(tokens, width, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    up = torch.randn(tokens, config.intermediate_size, device=device, dtype=dtype)
    ops: dict = {"tokens": tokens, "texts": len(batch)}
    for name, inputs in (("qkv_proj", x), ("out_proj", x), ("up_proj", x), ("down_proj", up)):
        ops[name] = _cuda_us(lambda i, name=name, inputs=inputs: F.linear(
            inputs, getattr(layers[i % num_layers], name).weight, getattr(layers[i % num_layers], name).bias),
            num_layers)
        linear = getattr(layers[0], name)
        ops[name + "_tflops"] = round(2 * tokens * linear.weight.numel() / ops[name] / 1e6, 1)
    ops["up_proj_no_bias"] = _cuda_us(lambda i: F.linear(x, layers[i % num_layers].up_proj.weight), num_layers)
    ops["up_proj_gelu_tanh_epilogue"] = _cuda_us(lambda i: torch._addmm_activation(
        layers[i % num_layers].up_proj.bias, x, layers[i % num_layers].up_proj.weight.t(), use_gelu=True), num_layers)
    double = torch.cat([x, x])
    ops["qkv_proj_twice_the_tokens"] = _cuda_us(lambda i: F.linear(
        double, layers[i % num_layers].qkv_proj.weight, layers[i % num_layers].qkv_proj.bias), num_layers)
    ops["gelu"] = _cuda_us(lambda i: F.gelu(up), num_layers)
    for chunk in (tokens, 4096, 2048):        # the feed-forward in token chunks: its GELU pass stays in L2
        ops[f"mlp_in_chunks_of_{chunk}"] = _cuda_us(lambda i, chunk=chunk: [
            layers[i % num_layers].down_proj(layers[i % num_layers].up_proj(x[first:first + chunk]))
            for first in range(0, tokens, chunk)], num_layers)
    norm = layers[0].attention_norm
    ops["add_then_layer_norm_torch"] = _cuda_us(
        lambda i: F.layer_norm(x + residual, (width,), norm.weight, norm.bias, norm.eps), num_layers)
    from hearth_llm import kernels

    ops["add_layer_norm_fused"] = _cuda_us(
        lambda i: kernels.layer_norm(x, norm.weight, norm.bias, norm.eps, residual=residual), num_layers)
    ops.update(_attention_us(layers[0], batch, x, device))
    return ops


def _attention_us(layer, batch: list[list[int]], x: torch.Tensor, device: torch.device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = [len(ids) for ids in batch]
    layout = PackedLayout.from_lengths(lengths, device)
    qkv = layer.qkv_proj(x)
    heads = layer.num_heads
    ops = {"attention_as_run": _cuda_us(lambda i: packed_attention(qkv, layout, heads), 24)}
    if len(set(lengths)) == 1:        # one run: the dense SDPA kernels can take it as [texts, heads, length, dim]
        query, key, value = qkv.view(len(lengths), lengths[0], 3, heads, -1).permute(2, 0, 3, 1, 4)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    ops[f"attention_sdpa_{backend.name.lower()}"] = _cuda_us(
                        lambda i: F.scaled_dot_product_attention(query, key, value), 24)
            except RuntimeError as error:
                ops[f"attention_sdpa_{backend.name.lower()}"] = f"refused: {str(error)[:80]}"
    return ops


def _forward_us(runner, batch: list[list[int]]) -> dict:
    """The encoder's forward pass over ``batch`` (no pooling, no copies), launched eagerly and
    replayed as one CUDA graph: the difference is what launching kernel by kernel costs."""
    input_ids, attention_mask = runner._padded(batch)
    layout = PackedLayout.from_lengths([len(ids) for ids in batch], runner.device)

    def forward() -> torch.Tensor:
        return runner.model(input_ids, attention_mask, layout=layout)

    result = {"eager": _cuda_us(lambda i: forward(), 5)}
    for name, patches in _forward_variants().items():     # the same forward with another kernel swapped in
        saved = {attribute: getattr(bert, attribute) for attribute in patches}
        try:
            for attribute, replacement in patches.items():
                setattr(bert, attribute, replacement)
            result[name] = _cuda_us(lambda i: forward(), 5)
        except RuntimeError as error:
            result[name] = f"failed: {type(error).__name__}: {str(error)[:120]}"
        finally:
            for attribute, original in saved.items():
                setattr(bert, attribute, original)
    if not torch.cuda.is_available():
        return result
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        result["cuda_graph"] = _cuda_us(lambda i: graph.replay(), 5)
    except RuntimeError as error:
        result["cuda_graph"] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return result


def _forward_variants() -> dict:
    """Kernels the forward pass could take instead, as replacements of bert.py's functions."""
    def torch_add_and_norm(x, residual, norm):
        return norm(residual + x)

    def dense_attention(backend):
        def attend(qkv, layout, num_heads):
            if len(layout.runs) != 1:
                return original_attention(qkv, layout, num_heads)
            _, num_texts, length = layout.runs[0]
            query, key, value = qkv.view(num_texts, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(query, key, value)
            return out.transpose(1, 2).reshape(qkv.shape[0], -1)
        return attend

    from torch.nn.attention import SDPBackend, sdpa_kernel

    original_attention = bert.packed_attention
    return {"torch_add_then_norm": {"add_and_norm": torch_add_and_norm},
            "sdpa_cudnn_attention": {"packed_attention": dense_attention(SDPBackend.CUDNN_ATTENTION)},
            "sdpa_flash_attention": {"packed_attention": dense_attention(SDPBackend.FLASH_ATTENTION)}}


def _profile(runner, batch: list[list[int]]) -> dict:
    """Device microseconds of one batch's forward pass by kernel kind, and the kernels' total
    against the wall time of the batch run alone."""
    from torch.profiler import ProfilerActivity, profile

    repeats = 3
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        for _ in range(repeats):
            runner.launch(batch).wait()
    by_kind: dict[str, float] = {}
    top = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0:
            continue
        kind = _kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + device_us / repeats
        top.append((device_us / repeats, event.key[:90], kind))
    wall_us = _wall(lambda: runner.launch(batch).wait()) * 1e6
    total = sum(by_kind.values())
    return {"kernel_us_by_kind": {kind: round(us, 1) for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernel_us_total": round(total, 1), "wall_us_one_batch_alone": round(wall_us, 1),
            "top_kernels": [[round(us, 1), name, kind] for us, name, kind in sorted(top, reverse=True)[:14]]}


def _kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(pattern in lowered for pattern in patterns):
            return kind
    return "other"
