"""CPU speed of the engine on the bundled SmolLM2-135M, side by side with HF transformers and llama.cpp.

    python -m hearth_llm.benchmarks.cpu [--hf-dtypes bfloat16,float32] [--skip-hf] [--skip-llama-cpp]

Every measure runs for every system in the same process and the same minute, because timings on a
shared machine drift: the numbers are meant to be read side by side, not against another run's.

1. single stream: decode tok/s over 128 new tokens after a short chat prompt (its prefill excluded);
2. 32 concurrent chat requests of 128 new tokens each: aggregate tok/s, prefill included;
3. prefill of a 500-token prompt: tok/s to the first token;
4. cold load: a fresh Python process, from its start to the first token of the default (GGUF) model.

Then the quality guard: greedy outputs of the default CPU dtype against float32 on 32 chat prompts.
HF transformers runs the same weights (our loader's dequantized GGUF) with ``generate``, a static
padded batch and ``generate_batch`` (continuous batching). llama.cpp runs the GGUF file itself when
``llama-cpp-python`` is importable (``pip install llama-cpp-python`` compiles it, ~9 minutes); it has
no batched generation API, so its "32 concurrent" row is requests one after another.

Timings are the best of ``--repeats`` runs after a warm-up; the table ends with the load average,
because every system here slows down several times over when other processes hold the cores.
All three share this process, as they would in a notebook: once two threads have each run OpenMP
work (HF in the main thread, our engine in its own), libgomp stops its idle threads from spinning
and every short parallel op pays a sleep and a wake-up; the engine's thread governor measures
which thread count each step size runs faster on, and the table after the results shows it.
Leave ``OMP_WAIT_POLICY`` unset to measure the defaults users get (``PASSIVE`` makes torch's idle
threads sleep: steadier on a busy machine, slower on a free one, for HF transformers as for us).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from hearth_llm.engine.cpu_features import describe_cpu_path

NUM_NEW_TOKENS = 128
NUM_CONCURRENT = 32
PREFILL_TOKENS = 500
QUALITY_PROMPTS = 32
QUALITY_NEW_TOKENS = 64

TOPICS = ["autumn leaves", "a lighthouse", "the moon", "a lost key", "coffee", "a mountain trail", "rain on a roof",
          "a city at night", "a friendly robot", "the ocean", "a library", "a thunderstorm", "a garden", "trains",
          "a snowy village", "a campfire", "a violin", "the desert", "a bakery", "fireflies", "a river",
          "an old map", "a clock tower", "honeybees", "a market", "a shipwreck", "the northern lights", "a kite",
          "a chess game", "a bicycle", "a volcano", "a paper boat"]
QUESTIONS = ["What is the capital of France?", "Give me three tips for staying focused while studying.",
             "Explain what a hash table is in two sentences.", "What is 12 multiplied by 7?",
             "Translate 'good morning' into Spanish.", "Name three planets in our solar system.",
             "Why is the sky blue? Answer briefly.", "What is photosynthesis?"]


@dataclass
class Row:
    """One measure for every system: name → value (or a note saying why there is none)."""

    column: str
    title: str
    unit: str
    values: dict[str, float | str] = field(default_factory=dict)


# ---- workloads ---------------------------------------------------------------------------------


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def single_stream_prompt(tokenizer, repeat: int) -> list[int]:
    return chat_ids(tokenizer, f"Tell me a long story about {TOPICS[repeat % len(TOPICS)]}.")


def concurrent_prompts(tokenizer, repeat: int) -> list[list[int]]:
    # A different wording per repeat, so a repeat does not find its prompts in the prefix cache.
    return [chat_ids(tokenizer, f"Write a short poem about {topic} ({repeat}).") for topic in TOPICS[:NUM_CONCURRENT]]


def long_prompt(tokenizer, repeat: int) -> list[int]:
    text = " ".join(f"Paragraph {i}: the {TOPICS[i % len(TOPICS)]} and {TOPICS[(i * 7) % len(TOPICS)]} "
                    f"were described at length by traveller number {i * 13 + repeat}." for i in range(60))
    ids = tokenizer.encode(text, add_special_tokens=False)[: PREFILL_TOKENS - 1]
    return [tokenizer.bos_token_id or 1, *ids]


# ---- hearth-llm ------------------------------------------------------------------------------
#
# Each system gives, per measure, a function of the repeat number that returns the measured rate;
# main() runs them interleaved, so all systems see the same stretch of machine load.


def hearth_runners():
    """``(runners, tokenizer, llm)`` for the engine with its default settings."""
    from hearth_llm.engine import LLM, SamplingParams, get_engine

    llm = LLM("default", show_progress=False)
    core = get_engine("default", show_progress=False)  # the engine llm drives, for its token streams
    tokenizer = llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    print(f"hearth-llm: dtype={llm.engine.runner.dtype}, threads={llm.config.num_threads}", flush=True)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up

    def decode_rate(repeat: int) -> float:
        times = []
        for output in core.add_request(single_stream_prompt(tokenizer, repeat), greedy):
            times.extend([time.perf_counter()] * len(output.delta_token_ids))
        return (len(times) - 1) / (times[-1] - times[0])

    def concurrent_rate(repeat: int) -> float:
        started = time.perf_counter()
        outputs = llm.generate(concurrent_prompts(tokenizer, repeat), greedy, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)

    def prefill_rate(repeat: int) -> float:
        prompt = long_prompt(tokenizer, repeat)
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return len(prompt) / (time.perf_counter() - started)

    return {"single": decode_rate, "concurrent": concurrent_rate, "prefill": prefill_rate}, tokenizer, llm


# ---- HF transformers -------------------------------------------------------------------------


class _TokenTimes:
    """A ``generate`` streamer that notes when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.has_seen_prompt = False

    def put(self, value) -> None:
        if self.has_seen_prompt:
            self.times.append(time.perf_counter())
        self.has_seen_prompt = True

    def end(self) -> None:
        pass


def hf_runners(dtype: torch.dtype, tokenizer) -> dict[str, dict]:
    """Runners of HF transformers ``generate`` (one stream, a static padded batch) and
    ``generate_batch`` (continuous batching), keyed by the row they fill."""
    from transformers import GenerationConfig

    from .hf_peer import default_model_in_transformers

    model, _ = default_model_in_transformers(dtype)
    name = str(dtype).removeprefix("torch.")
    greedy = dict(max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)

    @torch.inference_mode()
    def decode_rate(repeat: int) -> float:
        prompt, streamer = single_stream_prompt(tokenizer, repeat), _TokenTimes()
        model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       streamer=streamer, **greedy)
        return (len(streamer.times) - 1) / (streamer.times[-1] - streamer.times[0])

    @torch.inference_mode()
    def static_rate(repeat: int) -> float:
        prompts = concurrent_prompts(tokenizer, repeat)
        width = max(map(len, prompts))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        started = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, **greedy)
        return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - started)

    @torch.inference_mode()
    def continuous_rate(repeat: int) -> float:
        config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
        started = time.perf_counter()
        results = model.generate_batch(inputs=concurrent_prompts(tokenizer, repeat), generation_config=config,
                                       progress_bar=False)
        return sum(len(r.generated_tokens) for r in results.values()) / (time.perf_counter() - started)

    @torch.inference_mode()
    def prefill_rate(repeat: int) -> float:
        prompt = long_prompt(tokenizer, repeat)
        started = time.perf_counter()
        model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       max_new_tokens=1, do_sample=False, pad_token_id=0)
        return len(prompt) / (time.perf_counter() - started)

    decode_rate(0)  # warm-up
    return {f"HF {name}": {"single": decode_rate, "prefill": prefill_rate},
            f"HF {name} static": {"concurrent": static_rate},
            f"HF {name} continuous": {"concurrent": continuous_rate}}


# ---- llama.cpp -------------------------------------------------------------------------------


def llama_cpp_runners(tokenizer) -> dict:
    from llama_cpp import Llama

    from hearth_llm.engine.loader import default_model_path

    llm = Llama(str(default_model_path()), n_threads=torch.get_num_threads(), n_ctx=2048, n_batch=512, verbose=False)

    def generate(prompt: list[int]) -> list[float]:
        llm.reset()
        times = []
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == NUM_NEW_TOKENS:
                break
        return times

    def decode_rate(repeat: int) -> float:
        times = generate(single_stream_prompt(tokenizer, repeat))
        return (len(times) - 1) / (times[-1] - times[0])

    def sequential_rate(repeat: int) -> float:
        # Four requests one after another stand for 32: without batching the rate does not change.
        started = time.perf_counter()
        num_tokens = sum(len(generate(prompt)) for prompt in concurrent_prompts(tokenizer, repeat)[:4])
        return num_tokens / (time.perf_counter() - started)

    def prefill_rate(repeat: int) -> float:
        prompt = long_prompt(tokenizer, repeat)
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - started)

    decode_rate(0)  # warm-up
    return {"single": decode_rate, "concurrent": sequential_rate, "prefill": prefill_rate}


# ---- cold load -------------------------------------------------------------------------------

_COLD_HEARTH = """
from hearth_llm.engine import LLM, SamplingParams
llm = LLM("default", show_progress=False)
llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print("FIRST_TOKEN", flush=True)
"""
_COLD_LLAMA_CPP = """
from hearth_llm.engine.loader import default_model_path
from llama_cpp import Llama
llm = Llama(str(default_model_path()), n_threads={threads}, n_ctx=2048, verbose=False)
next(iter(llm.generate(llm.tokenize(b"Hi"), temp=0.0)))
print("FIRST_TOKEN", flush=True)
"""
_COLD_HF = """
import torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from hearth_llm.engine.loader import default_model_path
path = default_model_path()
tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
model.generate(**tokenizer("Hi", return_tensors="pt"), max_new_tokens=1)
print("FIRST_TOKEN", flush=True)
"""


def time_to_first_token(code: str, env: dict | None = None) -> float | str:
    """Seconds from launching a fresh interpreter to its ``FIRST_TOKEN`` line."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    for line in process.stdout:
        if line.startswith("FIRST_TOKEN"):
            elapsed = time.perf_counter() - started
            process.wait()
            return elapsed
    process.wait()
    return "failed: " + (process.stderr.read().strip().splitlines() or ["no output"])[-1][:70]


def cold_loads(args) -> dict[str, dict[str, float | str]]:
    loads: dict[str, dict[str, float | str]] = {}
    time_to_first_token(_COLD_HEARTH)  # writes the GGUF conversion cache if this is the first run ever
    loads["hearth-llm"] = {"cached": min(_number(time_to_first_token(_COLD_HEARTH)) for _ in range(args.repeats))}
    with tempfile.TemporaryDirectory() as home:  # an empty ~/.cache: the first load after install
        loads["hearth-llm"]["first"] = time_to_first_token(_COLD_HEARTH, {**os.environ, "HOME": home})
    if not args.skip_llama_cpp and _has_module("llama_cpp"):
        code = _COLD_LLAMA_CPP.format(threads=torch.get_num_threads())
        loads["llama.cpp"] = {"cached": min(_number(time_to_first_token(code)) for _ in range(args.repeats))}
    if not args.skip_hf:
        loads["HF"] = {"cached": time_to_first_token(_COLD_HF) if _has_module("accelerate")
                       else "needs accelerate to read GGUF (not installed)"}
    return loads


def _number(value: float | str) -> float:
    return value if isinstance(value, float) else float("inf")


# ---- quality guard ---------------------------------------------------------------------------


def quality_guard() -> dict:
    """Greedy outputs of the default dtype against float32 on the same prompts, EOS allowed."""
    from hearth_llm.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=QUALITY_NEW_TOKENS)
    prompts = [[{"role": "user", "content": text}]
               for text in [*QUESTIONS, *(f"Write a short poem about {topic}." for topic in TOPICS)][:QUALITY_PROMPTS]]
    outputs, resolved = {}, {}
    for dtype in ("auto", "float32"):
        with LLM("default", dtype=dtype, show_progress=False, kv_cache_memory="256MiB") as llm:
            outputs[dtype] = [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]
            resolved[dtype] = str(llm.engine.runner.dtype).removeprefix("torch.")
    num_identical, num_agreeing, num_reference = 0, 0, 0
    for fast, exact in zip(outputs["auto"], outputs["float32"]):
        prefix = next((i for i, (a, b) in enumerate(zip(fast, exact)) if a != b), min(len(fast), len(exact)))
        num_identical += fast == exact
        num_agreeing += prefix
        num_reference += len(exact)
    return {"dtype": resolved["auto"], "num_prompts": len(prompts), "num_identical": num_identical,
            "token_agreement": num_agreeing / num_reference}


# ---- report ----------------------------------------------------------------------------------


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def print_table(rows: list[Row], systems: list[str]) -> None:
    """One line per system, one column per measure; long notes go below the table."""
    widths = [max(len(row.column), 8) + 2 for row in rows]
    print("\n" + f"{'':<28}" + "".join(f"{row.column:>{w}}" for row, w in zip(rows, widths)))
    notes = []
    for system in systems:
        cells = []
        for row, width in zip(rows, widths):
            cell = _cell(row.values.get(system))
            if len(cell) >= width:
                notes.append(f"{system}, {row.column}: {cell}")
                cell = f"[{len(notes)}]"
            cells.append(f"{cell:>{width}}")
        print(f"{system:<28}" + "".join(cells))
    for row in rows:
        print(f"  {row.column}: {row.title}")
    if any("seq." in str(row.values.get("llama.cpp", "")) for row in rows):
        print("  seq.: llama-cpp-python has no batched generation; four requests one after another")
    for number, note in enumerate(notes, start=1):
        print(f"  [{number}] {note}")


def print_threads_used(threads_used: dict[int, dict[int, float]]) -> None:
    """What the engine's thread governor measured: median step time per thread count, per step size."""
    if not threads_used:
        return
    print("\nhearth-llm steps by size (tokens): median ms on each thread count, * = the one it runs")
    for bucket, times in threads_used.items():
        fastest = min(times, key=times.get)
        cells = "  ".join(f"{count} thr {seconds * 1e3:7.2f}{'*' if count == fastest else ' '}"
                          for count, seconds in times.items())
        print(f"  {2 ** (bucket - 1):>5}-{2 ** bucket - 1:<5} {cells}")


def print_goals(rows: dict[str, Row], hf_dtype: str | None) -> None:
    ours = lambda key: rows[key].values.get("hearth-llm")  # noqa: E731
    other = lambda key, system: rows[key].values.get(system)  # noqa: E731
    checks = [("single stream >= 1.0x llama.cpp", ours("single"), other("single", "llama.cpp"), 1.0)]
    if hf_dtype:
        checks += [
            (f"32 concurrent >= 4x HF continuous ({hf_dtype})", ours("concurrent"),
             other("concurrent", f"HF {hf_dtype} continuous"), 4.0),
            (f"32 concurrent >= 2x HF static batch ({hf_dtype})", ours("concurrent"),
             other("concurrent", f"HF {hf_dtype} static"), 2.0),
            (f"prefill >= 1.2x HF ({hf_dtype})", ours("prefill"), other("prefill", f"HF {hf_dtype}"), 1.2),
        ]
    print("\ngoals:")
    for label, mine, theirs, factor in checks:
        if isinstance(mine, float) and isinstance(theirs, float):
            verdict = "met" if mine >= factor * theirs else "NOT met"
            print(f"  {label:<48} {mine / theirs:5.2f}x  {verdict}")
        else:
            print(f"  {label:<48} n/a")
    cold = rows["cold"].values.get("hearth-llm")
    if isinstance(cold, float):
        print(f"  {'cold load (GGUF cache warm) <= 3 s':<48} {cold:5.2f}s  {'met' if cold <= 3 else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--interference" in argv:  # its own benchmark, with its own options (--interference --help)
        from .interference import main as interference_main

        interference_main([arg for arg in argv if arg != "--interference"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interference", action="store_true",
                        help="instead: the engine's speed while this thread runs torch, in-thread vs child "
                             "process (see benchmarks/interference.py; --interference --help for its options)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measure; the best one counts")
    parser.add_argument("--hf-dtypes", default="bfloat16", help="comma-separated, e.g. bfloat16,float32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    print(describe_cpu_path(), flush=True)  # which dtype dtype="auto" takes here, and the flags that decided
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average {load_before:.2f}", flush=True)
    rows = {key: Row(column, title, unit) for key, column, title, unit in [
        ("single", "decode tok/s", f"single-stream decode of {NUM_NEW_TOKENS} tokens", "tok/s"),
        ("concurrent", "32 chats tok/s", f"{NUM_CONCURRENT} concurrent chats x {NUM_NEW_TOKENS} tokens, aggregate",
         "tok/s"),
        ("prefill", "prefill tok/s", f"prefill of a {PREFILL_TOKENS}-token prompt", "tok/s"),
        ("cold", "cold load s", "fresh process to first token, GGUF conversion cached", "s"),
        ("cold_first", "first load s", "the same on the first run after install (nothing cached)", "s"),
    ]}

    runners, tokenizer, hearth_llm = hearth_runners()
    systems = {"hearth-llm": runners}
    hf_dtypes = [] if args.skip_hf else [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    for name in hf_dtypes:
        print(f"HF transformers {name} ...", flush=True)
        systems.update(hf_runners(getattr(torch, name), tokenizer))
    if not args.skip_llama_cpp:
        if _has_module("llama_cpp"):
            print("llama.cpp ...", flush=True)
            systems["llama.cpp"] = llama_cpp_runners(tokenizer)
        else:
            systems["llama.cpp"] = {}
            for key in ("single", "concurrent", "prefill", "cold"):
                rows[key].values["llama.cpp"] = "not installed"

    for key in ("single", "concurrent", "prefill"):
        print(f"measuring: {rows[key].title} ...", flush=True)
        for repeat in range(args.repeats):
            for system, measures in systems.items():
                if key not in measures:
                    continue
                try:
                    value = measures[key](repeat)
                except Exception as error:  # e.g. a young generate_batch; note it, go on
                    value = f"failed: {type(error).__name__}: {error}"[:80]
                previous = rows[key].values.get(system)
                # The best rate counts; a failure shows only when no repeat succeeded.
                if not isinstance(previous, float) or (isinstance(value, float) and value > previous):
                    rows[key].values[system] = value
    governor = hearth_llm.engine.thread_governor
    threads_used = governor.summary() if governor is not None else {}
    hearth_llm.close()
    if isinstance(rows["concurrent"].values.get("llama.cpp"), float):
        rows["concurrent"].values["llama.cpp"] = f"{rows['concurrent'].values['llama.cpp']:.1f} seq."
    systems = list(systems)

    if not args.skip_cold:
        print("cold loads ...", flush=True)
        for system, values in cold_loads(args).items():
            system = f"HF {hf_dtypes[0]}" if system == "HF" and hf_dtypes else system
            if system not in systems:
                continue
            rows["cold"].values[system] = values.get("cached")
            if "first" in values:
                rows["cold_first"].values[system] = values["first"]

    print_table(list(rows.values()), systems)
    print_threads_used(threads_used)
    print_goals(rows, hf_dtypes[0] if hf_dtypes else None)
    quality = None if args.skip_quality else quality_guard()
    if quality:
        print(f"\nquality guard: {quality['dtype']} vs float32, greedy, {quality['num_prompts']} chat prompts x up to "
              f"{QUALITY_NEW_TOKENS} tokens: {quality['num_identical']}/{quality['num_prompts']} identical, "
              f"{quality['token_agreement']:.1%} of float32's tokens agree before the first difference")
    load_after = os.getloadavg()[0]
    print(f"\nload average {load_before:.2f} before, {load_after:.2f} after"
          + ("  (a busy machine: rerun when it is quiet)" if max(load_before, load_after) > 1.5 else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"rows": {k: r.values for k, r in rows.items()}, "quality": quality,
                       "cpu": describe_cpu_path(),
                       "load": [load_before, load_after], "threads": torch.get_num_threads()}, file, indent=2)


if __name__ == "__main__":
    main()
