"""GPU throughput and latency against HF transformers, on random-weight models of real shapes.

    python -m hearth_llm.benchmarks.throughput --shape qwen3-0.6b
    python -m hearth_llm.benchmarks.throughput --shape llama3-8b --hf-num-seqs 64
    python -m hearth_llm.benchmarks.throughput --shape qwen3-0.6b --no-hf --compare-sync   # ours only
    python -m hearth_llm.benchmarks.throughput --shape qwen3-30b-a3b --no-hf   # MoE: no HF model at all
    python -m hearth_llm.benchmarks.throughput --shape tiny-qwen3-moe --device cpu --no-hf --num-seqs 4 \
        --lengths 8 16 --kv-cache-memory 64MiB   # a dry run of the whole path on CPU, in seconds

Workload (as nano-vllm's): 256 sequences, input and output lengths uniform in [100, 1024], random
token ids, EOS ignored, seed 0, greedy. The same weights run through HF transformers' continuous
batching (``continuous_batching_context_manager``) in the same process. Also batch-size-1 decode
ms/token for both, against the weight-read floor (weight bytes / copy bandwidth measured here).

On CUDA, after the throughput run, the other workloads of :mod:`.workloads` (``--workloads``): bs1 decode
timed as vLLM's side times it, the 64-request shared-prefix burst (a 2,048-token prefix never seen, then
one warmed by an earlier request) and the long-context mix (32 x 8,192-token prompts, 512 new tokens).
One engine runs them all, so ``max_model_len`` is 8,704 when the long mix runs (else 4,096).

``--vllm`` runs the same shape, workloads and options through vLLM first, in its own process
(:mod:`.vllm_side`, dummy weights), and prints the ratios (> 1: ours faster):

    python -m hearth_llm.benchmarks.throughput --shape llama3-8b --no-hf --vllm --vllm-pythonpath /tmp/vsite
    python -m hearth_llm.benchmarks.throughput --shape llama3-8b --skip-ours --vllm --vllm-pythonpath /tmp/vsite \
        --vllm-json vllm.json                                   # vLLM's side only, e.g. in another device session
    python -m hearth_llm.benchmarks.throughput --compare ours.json vllm.json   # the table, no device

Checkpoints carry hub names (one tensor per expert for MoE), as real checkpoints do. With ``--no-hf``
no HF model is built: each weight is made on the device as our loader reads it
(:mod:`.random_weights`), so the device holds one copy of the weights, not two.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping

import torch

from .random_weights import RandomWeights, checkpoint_shapes, hub_state_dict
from .shapes import SHAPES, shape_fields
from .vllm_peer import format_ratio_table
from .workloads import max_model_len_for, workload

# By exact architecture: a family prefix would build a dense Qwen3 for Qwen3Moe, dropping the experts.
CONFIG_CLASSES = {"Qwen3ForCausalLM": "Qwen3Config", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
                  "LlamaForCausalLM": "LlamaConfig", "MixtralForCausalLM": "MixtralConfig"}


def hf_config(shape: str, num_layers: int | None = None, max_model_len: int | None = None):
    """The HF config of ``shape``; ``max_model_len`` raises a shorter ``max_position_embeddings``
    (:func:`.shapes.shape_fields`)."""
    import transformers

    fields = shape_fields(shape, max_model_len)
    architecture = fields.pop("architecture")
    if architecture not in CONFIG_CLASSES:
        raise ValueError(f"shape {shape!r}: architecture {architecture!r} has no config class here; "
                         f"known: {sorted(CONFIG_CLASSES)}")
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config_class = getattr(transformers, CONFIG_CLASSES[architecture])
    return config_class(**fields, architectures=[architecture], bos_token_id=0, eos_token_id=1, pad_token_id=0)


def placeholder_tokenizer(vocab_size: int):
    """Token ids in, token ids out: the benchmark never needs text."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t1", pad_token="t0", unk_token="t2")


def random_model(shape: str, dtype: torch.dtype, device: str, num_layers: int | None = None,
                 max_model_len: int | None = None):
    """An HF model with random weights of the given shape, and the same weights as our checkpoint
    (hub names; fused experts split into views, so the checkpoint itself copies nothing)."""
    from transformers import AutoModelForCausalLM

    from hearth_llm.engine.loader.checkpoint import LoadedCheckpoint

    config = hf_config(shape, num_layers, max_model_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    checkpoint = LoadedCheckpoint(config=config, state_dict=hub_state_dict(model.state_dict(), config),
                                  tokenizer=placeholder_tokenizer(config.vocab_size), source=shape)
    return model, checkpoint


def random_checkpoint(shape: str, dtype: torch.dtype, device: str, num_layers: int | None = None,
                      max_model_len: int | None = None):
    """Our checkpoint alone, no HF model: each weight is made on ``device`` when the loader reads it.
    Returns the :class:`RandomWeights` (names, shapes, bytes) and the checkpoint over them.

    >>> weights, checkpoint = random_checkpoint("tiny-qwen3-moe", torch.float32, "cpu")
    >>> weights.shapes["model.layers.0.mlp.experts.7.down_proj.weight"]
    (64, 32)
    """
    from hearth_llm.engine.loader.checkpoint import LoadedCheckpoint

    config = hf_config(shape, num_layers, max_model_len)
    weights = RandomWeights(checkpoint_shapes(config, dtype), dtype, device, std=config.initializer_range)
    # A stream, not a state_dict: the checkpoint would read every tensor for its shapes, then list them all.
    checkpoint = LoadedCheckpoint(config, placeholder_tokenizer(config.vocab_size), shape,
                                  weight_stream=lambda: iter(weights.items()), dtype=dtype,
                                  weight_shapes={name: (dims, shape) for name, dims in weights.shapes.items()})
    return weights, checkpoint


def active_weight_bytes(shapes: Mapping[str, tuple[int, ...]], config, element_size: int) -> int | None:
    """Bytes of weights one decoded token reads on a MoE model: all but the experts, and
    ``num_experts_per_tok`` of each layer's experts (hub or fused names); None for a dense model.

    >>> active_weight_bytes(random_checkpoint("tiny-mixtral", torch.bfloat16, "cpu")[0].shapes,
    ...                     hf_config("tiny-mixtral"), 2)  # 2 of 4 experts
    2721408
    """
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not num_experts:
        return None
    experts = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
    others = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." not in name)
    return (others + experts * config.num_experts_per_tok // num_experts) * element_size


def our_engine(checkpoint, dtype: str, max_num_seqs: int = 256, kv_cache_memory: str = "40GiB",
               max_model_len: int = 4096, max_num_batched_tokens: int = 16384, async_scheduling: bool | None = None,
               device: str = "cuda"):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine

    config = EngineConfig(model=checkpoint.source, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                          max_model_len=max_model_len, show_progress=False, async_scheduling=async_scheduling)
    return LLMEngine(config, checkpoint=checkpoint)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(engine, requests, kernel_profile: str | None = None, lengths: tuple[int, int] = (100, 1024)) -> dict:
    """Our engine on the workload; ``kernel_profile`` names a file for a torch.profiler table of
    20 steps in the middle of the run (the steps run a little slower while profiled); ``lengths``
    bound the warm-up prompts as the workload's."""
    from hearth_llm.engine.sampling_params import SamplingParams

    def params(max_tokens):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    device = engine.runner.device
    # Warm-up on other prompts (no prefix hits later): batches of 1, 16 and 17 prompts compile
    # every specialization of the Triton kernels the workload meets.
    for count in (1, 16, 17):
        for prompt, _ in workload(count, seed=count, low=lengths[0], high=lengths[1]):
            engine.add_request(prompt, params(4))
        while engine.has_unfinished_requests():
            engine.step()
    synchronize(device)
    started = time.perf_counter()
    for prompt, max_tokens in requests:
        engine.add_request(prompt, params(max_tokens))
    num_output, num_steps, profiler = 0, 0, None
    step_ends = [started]
    while engine.has_unfinished_requests():
        if kernel_profile and num_steps == 300:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        num_output += sum(len(d.new_token_ids) for d in engine.step())
        num_steps += 1
        step_ends.append(time.perf_counter())
        if profiler is not None and num_steps == 320:
            synchronize(device)
            profiler.__exit__(None, None, None)
            with open(kernel_profile, "w") as sink:
                sink.write(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30))
                sink.write("\n\n" + profiler.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            profiler = None
    synchronize(device)
    elapsed = time.perf_counter() - started
    for request_id in list(engine.groups):
        engine.release(request_id)
    step_ms = sorted((b - a) * 1000 for a, b in zip(step_ends, step_ends[1:]))
    return {"seconds": elapsed, "output_tokens": num_output, "tok_per_s": num_output / elapsed,
            "steps": num_steps, "preemptions": engine.scheduler.num_preemptions,
            "step_ms_p50": step_ms[len(step_ms) // 2], "step_ms_p90": step_ms[len(step_ms) * 9 // 10],
            "step_ms_max": step_ms[-1], "seconds_in_steps_over_50ms": sum(t for t in step_ms if t > 50) / 1000}


def run_hf_continuous_batching(model, requests) -> dict:
    from transformers import GenerationConfig

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in requests),
                                         eos_token_id=-1, pad_token_id=0)
    num_output = 0
    started = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=generation_config, block=True,
                                                   timeout=30) as manager:
        for index, (prompt, max_tokens) in enumerate(requests):
            manager.add_request(input_ids=prompt, request_id=f"r{index}", max_new_tokens=max_tokens,
                                eos_token_id=-1)
        num_finished = 0
        while num_finished < len(requests):
            result = manager.get_result(timeout=60)
            if result is not None and result.is_finished():
                num_finished += 1
                num_output += len(result.generated_tokens)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "output_tokens": num_output, "tok_per_s": num_output / elapsed}


def copy_bandwidth_bytes_per_s(device: torch.device = torch.device("cuda"), num_bytes: int = 2 * 2**30) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    synchronize(device)
    seconds = (time.perf_counter() - started) / 10
    del source, target
    return 2 * num_bytes / seconds  # read + write


def ours_bs1_ms_per_token(engine, num_tokens: int = 128) -> float:
    from hearth_llm.engine.sampling_params import SamplingParams

    engine.add_request(list(range(16)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()  # prefill + first token: not timed
    engine.add_request(list(range(100, 132)), SamplingParams(
        temperature=0, max_tokens=num_tokens + 1, ignore_eos=True, detokenize=False))
    engine.step()
    synchronize(engine.runner.device)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    synchronize(engine.runner.device)
    for rid in list(engine.groups):
        engine.release(rid)
    return (time.perf_counter() - started) * 1000 / num_tokens


def decode_graph_bs1_ms(engine, num_replays: int = 100) -> float | None:
    """Device time of one batch-size-1 decode forward (graph replay, no lm_head or sampling), so the
    bs1 ms/token above splits into device time and host time the device waits for."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return None
    graph = graphs.graphs[1]  # its buffers still hold the last bs1 step: replays rewrite that KV slot
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / num_replays


def hf_bs1_ms_per_token(model, num_tokens: int = 64) -> float:
    input_ids = torch.arange(100, 132, device="cuda")[None]
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(input_ids))
    model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    started = time.perf_counter()
    model.generate(input_ids, max_new_tokens=num_tokens + 1, min_new_tokens=num_tokens + 1, **kwargs)
    torch.cuda.synchronize()
    return (time.perf_counter() - started - first) * 1000 / num_tokens


def check_room_for_hf(parser: argparse.ArgumentParser, shape: str, kv_cache_memory: str) -> None:
    """The HF column keeps HF's model beside ours: two copies of the weights plus our KV cache
    must fit the device, else stop now (before minutes of building) and say what to pass."""
    from hearth_llm.engine.config import parse_bytes

    weight_bytes = RandomWeights(checkpoint_shapes(hf_config(shape), torch.bfloat16), torch.bfloat16, "meta",
                                 std=0.0).num_bytes
    needed = 2 * weight_bytes + parse_bytes("--kv-cache-memory", kv_cache_memory)
    _, total = torch.cuda.mem_get_info()
    if needed > total:
        parser.error(f"--shape {shape} with HF needs {needed / 2**30:.1f} GiB (two copies of "
                     f"{weight_bytes / 2**30:.1f} GiB of weights + {kv_cache_memory} of KV), the device has "
                     f"{total / 2**30:.1f} GiB: add --no-hf (ours only, one copy) or lower --kv-cache-memory")


def engine_generate(engine):
    """``generate(prompts, max_tokens) -> (seconds, output tokens)`` on our engine: one batch added
    at once and stepped to its end, timed from the first add to the last token on the device, as
    :func:`.vllm_side.run_workloads` times ``LLM.generate`` on vLLM's."""
    from hearth_llm.engine.sampling_params import SamplingParams

    device = engine.runner.device

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
        synchronize(device)
        started = time.perf_counter()
        for prompt, count in zip(prompts, max_tokens):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=count, ignore_eos=True,
                                                      detokenize=False))
        num_output = 0
        while engine.has_unfinished_requests():
            num_output += sum(len(delta.new_token_ids) for delta in engine.step())
        synchronize(device)
        elapsed = time.perf_counter() - started
        for request_id in list(engine.groups):
            engine.release(request_id)
        return elapsed, num_output

    return generate


def build_parser() -> argparse.ArgumentParser:
    from .vllm_side import WORKLOADS, add_workload_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    add_workload_options(parser)  # --num-seqs, --lengths, the burst and long-context sizes, engine limits
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                        help="what to run besides HF's column: throughput (the 256 seqs), bs1 (decode ms/token, "
                             "as vLLM's side times it), burst (the shared-prefix burst), long (the long-context "
                             "mix); default all on cuda, throughput on cpu")
    parser.add_argument("--hf-num-seqs", type=int, default=256, help="0 skips HF's throughput run")
    parser.add_argument("--kv-cache-memory", default="40GiB")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile", help="write a cProfile summary of our run here")
    parser.add_argument("--kernel-profile", help="write a torch.profiler table of 20 mid-run steps here")
    parser.add_argument("--no-hf", action="store_true",
                        help="skip HF entirely (throughput and bs1); no HF model is built, so the device holds "
                             "one copy of the weights (the MoE shapes need this on one H200)")
    parser.add_argument("--compare-sync", action="store_true",
                        help="also run ours with async scheduling off, on the same engine settings")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the bench path on a tiny shape (needs --no-hf)")
    peer = parser.add_argument_group("vLLM as the peer (in a subprocess; never imported here)")
    peer.add_argument("--vllm", action="store_true",
                      help="also run the same workloads, shape and options through vLLM (dummy weights), "
                           "before ours, and print our/vLLM ratios")
    peer.add_argument("--vllm-python", default=sys.executable, help="the interpreter that runs vLLM's side")
    peer.add_argument("--vllm-pythonpath", help="put this first on its PYTHONPATH (where vLLM is unpacked)")
    peer.add_argument("--vllm-json", help="vLLM's results go here (default: beside --json, or a temp file)")
    peer.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's")
    peer.add_argument("--skip-ours", action="store_true", help="with --vllm: vLLM's side only")
    peer.add_argument("--compare", nargs=2, metavar=("OURS_JSON", "VLLM_JSON"),
                      help="print the ratio table of two earlier runs' JSON files and stop (no device needed)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        print_comparison(*args.compare)
        return
    if args.device == "cpu" and not args.no_hf:
        parser.error("--device cpu runs ours only; add --no-hf")
    if not 1 <= args.lengths[0] <= args.lengths[1]:
        parser.error(f"--lengths {args.lengths[0]} {args.lengths[1]}: need 1 <= LOW <= HIGH")
    if args.skip_ours and not args.vllm:
        parser.error("--skip-ours runs nothing without --vllm")
    if args.workloads is None:
        args.workloads = ["throughput"] if args.device == "cpu" else ["throughput", "bs1", "burst", "long"]
    if args.max_model_len is None:
        args.max_model_len = max_model_len_for(args.long_context if "long" in args.workloads else None)
    results = {"shape": args.shape, "workloads": args.workloads,
               "options": dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               max_model_len=args.max_model_len)}
    if args.vllm:  # first: vLLM's process has the whole device, and ends before ours starts
        results["vllm"] = run_peer(parser, args)
    if not args.skip_ours:
        results.update(run_ours_side(parser, args))
    if "vllm" in results and "measures" in results:
        print(format_ratio_table(results["measures"], results["vllm"]["measures"], args.shape))
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=2)


def run_peer(parser: argparse.ArgumentParser, args) -> dict:
    """vLLM's side through :mod:`.vllm_peer`; a clear parser error if it cannot run."""
    import tempfile

    from .vllm_peer import VLLMUnavailable, run_vllm_side, vllm_environment

    json_path = args.vllm_json or (args.json.removesuffix(".json") + ".vllm.json" if args.json
                                   else tempfile.mkstemp(prefix="vllm-side-", suffix=".json")[1])
    arguments = ["--shape", args.shape, "--workloads", *args.workloads, "--num-seqs", str(args.num_seqs),
                 "--lengths", *map(str, args.lengths), "--prefix-burst", *map(str, args.prefix_burst),
                 "--long-context", *map(str, args.long_context), "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                 "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    print(f"vLLM's side: {args.vllm_python} -m hearth_llm.benchmarks.vllm_side {' '.join(arguments)}",
          file=sys.stderr, flush=True)
    try:
        peer = run_vllm_side(args.vllm_python, vllm_environment(args.vllm_pythonpath), arguments, json_path)
    except VLLMUnavailable as error:
        parser.error(f"--vllm: {error}")
    print(f"vLLM's side done: {json.dumps(peer)}", file=sys.stderr, flush=True)
    return peer


def print_comparison(ours_path: str, peer_path: str) -> None:
    from .vllm_peer import format_ratio_table

    with open(ours_path) as source:
        ours = json.load(source)
    with open(peer_path) as source:
        peer = json.load(source)
    peer = peer.get("vllm", peer)  # a whole --vllm run's JSON, or vLLM's side's own
    print(format_ratio_table(ours["measures"], peer["measures"], ours["shape"]))


def run_ours_side(parser: argparse.ArgumentParser, args) -> dict:
    device = torch.device(args.device)
    if not args.no_hf:
        check_room_for_hf(parser, args.shape, args.kv_cache_memory)

    if args.no_hf:
        model = None
        weights, checkpoint = random_checkpoint(args.shape, torch.bfloat16, args.device,
                                                max_model_len=args.max_model_len)
        weight_bytes, shapes = weights.num_bytes, weights.shapes
    else:
        model, checkpoint = random_model(args.shape, torch.bfloat16, "cuda", max_model_len=args.max_model_len)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    active_bytes = active_weight_bytes(shapes, checkpoint.config, 2)
    engine = our_engine(checkpoint, "bfloat16", max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
                        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                        device=args.device)
    del checkpoint
    requests = workload(args.num_seqs, low=args.lengths[0], high=args.lengths[1])
    results = {"weight_bytes": weight_bytes, "kv_cache_tokens": engine.runner.num_blocks * engine.config.block_size}
    if active_bytes is not None:
        results["active_weight_bytes"] = active_bytes
    if args.profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        results["ours"] = profiler.runcall(run_ours, engine, requests, None, args.lengths)
        summary = io.StringIO()
        pstats.Stats(profiler, stream=summary).sort_stats("tottime").print_stats(30)
        with open(args.profile, "w") as sink:
            sink.write(summary.getvalue())
    else:
        results["ours"] = run_ours(engine, requests, args.kernel_profile, args.lengths)
    print(json.dumps(results["ours"]), flush=True)
    results["ours_bs1_ms_per_token"] = ours_bs1_ms_per_token(engine)
    results["ours_bs1_decode_graph_ms"] = decode_graph_bs1_ms(engine)
    measures = {"throughput_tok_s": results["ours"]["tok_per_s"], "throughput_s": results["ours"]["seconds"],
                "throughput_output_tokens": results["ours"]["output_tokens"]}
    others = [name for name in args.workloads if name != "throughput"]
    if others:  # the same arithmetic and ids as vLLM's side (its warm-up again: a few ms)
        from .vllm_side import run_workloads

        measures.update(run_workloads(engine_generate(engine), argparse.Namespace(**{**vars(args),
                                                                                     "workloads": others})))
        results["preemptions_after_all_workloads"] = engine.scheduler.num_preemptions
    results["measures"] = measures
    if args.compare_sync:
        engine.async_scheduling = False
        # The same lengths, other ids: the first run's prompts sit in the prefix cache.
        shifted = [([(t + 1) % 10000 for t in prompt], max_tokens) for prompt, max_tokens in requests]
        results["ours_sync"] = run_ours(engine, shifted, lengths=args.lengths)
        results["ours_sync_bs1_ms_per_token"] = ours_bs1_ms_per_token(engine)
        print(json.dumps(results["ours_sync"]), flush=True)
    bandwidth = copy_bandwidth_bytes_per_s(device, 2 * 2**30 if device.type == "cuda" else 2**26)
    results["copy_bandwidth_TBps"] = bandwidth / 1e12
    results["weight_read_floor_ms"] = weight_bytes / bandwidth * 1000
    if active_bytes is not None:  # MoE: a batch-1 decode step reads only its token's experts
        results["active_weight_read_floor_ms"] = active_bytes / bandwidth * 1000
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf:
        results["hf_bs1_ms_per_token"] = hf_bs1_ms_per_token(model)
    if args.hf_num_seqs and not args.no_hf:
        hf_requests = requests[: args.hf_num_seqs]
        results["hf_continuous_batching"] = run_hf_continuous_batching(model, hf_requests)
        results["hf_num_seqs"] = len(hf_requests)
        results["ratio"] = results["ours"]["tok_per_s"] / results["hf_continuous_batching"]["tok_per_s"]
    return results


if __name__ == "__main__":
    main()
