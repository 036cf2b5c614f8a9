"""Speculative decoding at batch 1: decode tokens/s with and without proposals, in the same process.

    hearth-llm bench spec [--k 4] [--max-tokens 96] [--repeats 2] [--draft default]
    hearth-llm bench spec --overhead-shape llama3-8b --device cuda      # the H200 variant

1. Real weights (the bundled SmolLM2-135M by default, so acceptance is real): the ``make demo``
   RAG questions as the demo asks them (its system prompt and wording, the handbook page that
   answers the question as context), an extraction prompt (copy fields out of a pasted order),
   and with ``--quote-prompts`` the older variant (the whole handbook, "quote it word for word").
   Each runs greedy, alone, without speculation and
   with n-gram prompt lookup (and a draft model with ``--draft``; ``--draft default`` is
   SmolLM2 drafting for itself, a sanity check of the draft path: acceptance about 100 %).
   Decode tokens/s count from the first token to the last (prefix caching is off so every run
   prefills alike); ``--clock cpu`` counts the engine thread's CPU time instead of wall time, for
   a machine shared with other work (1 thread: the forward passes run on that thread), and
   ``--clock both`` reports CPU time and wall time of the same runs side by side, with the load
   average after each prompt. The n-gram engine uses lookup lengths ``--lookup-min``..``--lookup-max``
   (default 2..4), ``--lookup-backoff`` turns ``prompt_lookup_backoff`` on, ``--no-adaptive-length``
   turns ``adaptive_proposal_length`` off (on by default: on the CPU only the tokens of a match that
   pay for their verify rows are proposed), and ``--baseline-ngram 2-4`` adds an engine with those
   lengths, no backoff and whole matches proposed to the same runs (the policy before adaptive
   lengths). The systems take turns run by run. Outputs are checked token-equal to the plain run
   (in bfloat16 a verify step's attention can round a few values differently from a decode
   step's, so a near-tie may flip; float32 is exact).
   The CPU thread count is fixed (``--adaptive-threads`` lets the governor choose: its choices
   change bfloat16 rounding from run to run, so even two plain runs can differ).
2. The verification overhead: the cost of one step that verifies ``k`` proposals (forced: a
   proposer that always proposes ``k`` tokens) against a plain decode step, and from the two the
   effective ms/token at acceptance rates 0.5/0.7/0.9 (per-position acceptance ``a`` i.i.d.: a
   step yields ``(1 - a^(k+1)) / (1 - a)`` tokens). ``--overhead-shape`` runs it alone on a
   random-weight model of that shape (``benchmarks.throughput.SHAPES``), for GPUs.
"""
from __future__ import annotations

import argparse
import os
import time
from importlib import util
from pathlib import Path

import torch

# The demo's RAG questions, each with the handbook page that answers it (the demo retrieves one page),
# and its prompt wording (integrations/demo, not imported here: that would pull in LangChain).
DEMO_QUESTIONS = {
    "How often should I descale the kettle if my water is hard?": "04-descaling.md",
    "How much does express delivery cost?": "08-returns-and-shipping.md",
    "What does error code E1 mean?": "06-error-codes.md",
}
DEMO_SYSTEM = ("You are a helpful assistant for the Larkspur Wren kettle. "
               "Answer in one short sentence, using only the handbook.")
DEMO_HUMAN = "Handbook:\n{context}\n\nQuestion: {question}"
QUESTIONS = [
    "How often should I descale the kettle if my water is hard?",
    "What does error code E1 mean?",
]
RAG_SYSTEM = "You answer questions about the Larkspur Wren kettle by quoting the handbook word for word."
RAG_USER = "Handbook:\n{context}\n\nQuestion: {question}\nQuote the handbook sentences that answer it."
ORDER = """ORDER CONFIRMATION
Order number: LW-2026-118734
Date: 14 November 2026
Customer: Marguerite Okonkwo-Lindqvist
Email: m.okonkwo@example.org
Shipping address: Flat 3, 27 Alder Row, Bristol BS6 5QT, United Kingdom
Items:
- 1 x Larkspur Wren electric kettle, colour Slate Grey, 1.7 litre (LW-KTL-17-SG) at 89.00 GBP
- 2 x Larkspur descaler sachets, pack of 6 (LW-DSC-06) at 7.50 GBP
- 1 x Replacement limescale filter (LW-FLT-01) at 6.00 GBP
Shipping: Express delivery, 2 working days, 6.95 GBP
Total: 116.95 GBP
Payment: Visa ending 4421"""
EXTRACT_USER = ("Document:\n{document}\n\nCopy these fields exactly as they appear in the document, one per line "
                "as 'field: value': order number, customer, email, shipping address, each item line, total.")


def handbook_folder() -> Path:
    """The demo's handbook pages (found without importing the demo, which would pull in LangChain)."""
    spec = util.find_spec("hearth_llm.integrations")
    return Path(list(spec.submodule_search_locations)[0]) / "demo" / "corpus"


def handbook_text() -> str:
    return "\n\n".join(page.read_text(encoding="utf-8") for page in sorted(handbook_folder().glob("*.md")))


def workloads(tokenizer, quote_prompts: bool = False) -> dict[str, list[int]]:
    def chat(system: str | None, user: str) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    folder = handbook_folder()
    prompts = {f"rag {i + 1}": chat(DEMO_SYSTEM, DEMO_HUMAN.format(context=(folder / page).read_text(encoding="utf-8"),
                                                                   question=question))
               for i, (question, page) in enumerate(DEMO_QUESTIONS.items())}
    if quote_prompts:
        context = handbook_text()
        prompts.update({f"rag-quote {i + 1}": chat(RAG_SYSTEM, RAG_USER.format(context=context, question=q))
                        for i, q in enumerate(QUESTIONS)})
    prompts["extraction"] = chat(None, EXTRACT_USER.format(document=ORDER))
    return prompts


CLOCK = [time.perf_counter]  # --clock cpu: time.thread_time
# Wall seconds after the first token of the last run_one, whatever CLOCK is (--clock both reports it too).
LAST_WALL_DECODE = [0.0]


class ForcedProposer:
    """Always ``k`` proposals (copies of the last token): what a verification step costs,
    whatever the acceptance."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests, max_num_tokens: list[int]) -> list[list[int]]:
        return [[r.token_ids[-1]] * min(self.k, room) for r, room in zip(requests, max_num_tokens)]

    def forget_finished(self) -> None:
        pass


def make_engine(model: str, speculative: dict | None, args, checkpoint=None):
    from hearth_llm.engine.config import EngineConfig
    from hearth_llm.engine.llm_engine import LLMEngine

    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, enable_prefix_caching=False,
                          kv_cache_memory=args.kv_cache_memory, show_progress=False, speculative=speculative,
                          adaptive_threads=getattr(args, "adaptive_threads", False),
                          **({"max_num_seqs": args.max_num_seqs} if getattr(args, "max_num_seqs", None) else {}),
                          **({"cpu_int8_activations": True} if getattr(args, "cpu_int8_activations", False) else {}),
                          num_threads=getattr(args, "num_threads", None))
    return LLMEngine(config, checkpoint=checkpoint)


def run_one(engine, prompt: list[int], max_tokens: int, speculative: bool = True,
            ignore_eos: bool = False) -> tuple[list[int], float, int, float]:
    """Greedy tokens, wall seconds, steps and seconds after the first token of one request run alone."""
    from hearth_llm.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, speculative=speculative,
                            ignore_eos=ignore_eos)
    request_id = engine.add_request(prompt, params)
    tokens, num_steps, first_token_at = [], 0, None
    _synchronize(engine)
    started = CLOCK[0]()
    wall_first = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
        num_steps += 1
        if tokens and first_token_at is None:
            first_token_at = CLOCK[0]()  # the prefill's step (CPU: the host has waited for it)
            wall_first = time.perf_counter()
    _synchronize(engine)
    ended = CLOCK[0]()
    LAST_WALL_DECODE[0] = time.perf_counter() - (wall_first or time.perf_counter())
    engine.release(request_id)
    return tokens, ended - started, num_steps, ended - (first_token_at or ended)


def spec_counters(engine) -> tuple[int, int, int]:
    stats = engine.stats()
    return tuple(stats[f"spec_decode_num_{name}"] for name in ("drafts", "draft_tokens", "accepted_tokens"))


def real_weights_table(args) -> None:
    engines = {"no speculation": make_engine(args.model, None, args)}
    engines[f"ngram k={args.k}"] = make_engine(args.model, {
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max, "prompt_lookup_backoff": args.lookup_backoff,
        "adaptive_proposal_length": args.adaptive_length}, args)
    if args.baseline_ngram:  # the previous default policy, in the same interleaved runs
        low, high = (int(n) for n in args.baseline_ngram.split("-"))
        engines[f"ngram k={args.k} n{low}-{high} whole matches"] = make_engine(args.model, {
            "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": low,
            "prompt_lookup_max": high, "prompt_lookup_backoff": False, "adaptive_proposal_length": False}, args)
    if args.draft:
        engines[f"draft {Path(args.draft).name} k={args.k}"] = make_engine(args.model, {
            "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}, args)
    both = args.clock == "both"
    rate_columns = "decode tok/s (CPU time) | speedup | decode tok/s (wall) | speedup" if both else "decode tok/s | speedup"
    print(f"| prompt | tokens in/out | system | {rate_columns} | acceptance | tokens per verify step | equal | load |")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if both else ""), flush=True)
    for name, prompt in workloads(engines["no speculation"].tokenizer, args.quote_prompts).items():
        for engine in engines.values():
            run_one(engine, prompt, 8)  # warm-up
        before = {system: spec_counters(engine) for system, engine in engines.items() if engine.proposer}
        outputs = interleaved_rates(engines, prompt, args.max_tokens, args.repeats)
        load = "/".join(f"{value:.1f}" for value in os.getloadavg())
        reference, plain_rate, plain_wall = outputs.pop("no speculation")

        def rates(rate: float, wall: float) -> str:
            text = f"{rate:.1f} | {rate / plain_rate:.2f}x"
            return text + (f" | {wall:.1f} | {wall / plain_wall:.2f}x" if both else "")

        print(f"| {name} | {len(prompt)}/{len(reference)} | no speculation | {rates(plain_rate, plain_wall)} "
              f"| | | | {load} |")
        for system, (tokens, rate, wall) in outputs.items():
            drafts, proposed, accepted = (a - b for a, b in zip(spec_counters(engines[system]), before[system]))
            acceptance = accepted / proposed if proposed else 0.0
            per_step = 1 + accepted / drafts if drafts else 1.0
            print(f"| {name} | {len(prompt)}/{len(tokens)} | {system} | {rates(rate, wall)} | {acceptance:.0%} | "
                  f"{per_step:.2f} | {'yes' if tokens == reference else 'NO'} | {load} |", flush=True)
    for system, engine in engines.items():  # what the adaptive proposal lengths measured on this machine
        measured = getattr(getattr(engine.proposer, "step_cost", None), "measured", None)
        if measured is not None:
            costs = " / ".join(f"{rows}: {cost:.2f}" for rows, cost in measured().items())
            print(f"\n{system}: measured step costs by rows (decode step = 1): {costs}", flush=True)


def interleaved_rates(engines: dict, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    """Per system, (its tokens, best decode tokens/s of ``repeats`` runs by CLOCK, best by the wall
    clock); the systems take turns run by run, so a burst of load on a shared machine hits them alike."""
    best = {system: ([], 0.0, 0.0) for system in engines}
    for _ in range(repeats):
        for system, engine in engines.items():
            tokens, _, _, decode_seconds = run_one(engine, prompt, max_tokens)
            rate = (len(tokens) - 1) / max(decode_seconds, 1e-9)
            wall = (len(tokens) - 1) / max(LAST_WALL_DECODE[0], 1e-9)
            best[system] = (tokens, max(best[system][1], rate), max(best[system][2], wall))
    return best


def overhead_table(engine, k: int, num_tokens: int, repeats: int) -> None:
    """Per-step cost of a plain decode step and of verifying ``k`` forced proposals, with the CUDA
    graphs (when captured) and without them, and plain decode with async scheduling. Rows print as
    they are measured."""
    prompt = list(range(100, 132))
    engine.proposer = ForcedProposer(k)
    run_one(engine, prompt, 16, speculative=False, ignore_eos=True)
    run_one(engine, prompt, 16, ignore_eos=True)

    def ms_per_step(speculative: bool) -> float:
        """Best ms per step after the prefill's (whatever the proposals' fate: a step costs the same)."""
        runs = [run_one(engine, prompt, num_tokens, speculative=speculative, ignore_eos=True) for _ in range(repeats)]
        return min(run[3] * 1000 / max(run[2] - 1, 1) for run in runs)

    graphs = engine.runner.decode_graphs
    print(f"\nverification overhead, batch 1, k={k} (ms per step after the prefill, best of {repeats} runs of "
          f"{num_tokens} tokens; CUDA graphs: {'on' if graphs is not None else 'off'})")
    print("| step | ms | vs decode step |")
    print("|---|---|---|")
    plain_ms = ms_per_step(False)
    _print_step_row("decode step", plain_ms, plain_ms)
    verify_ms = ms_per_step(True)
    _print_step_row(f"verify step (1+{k} tokens)", verify_ms, plain_ms)
    base_ms = plain_ms
    if graphs is not None:  # the same steps eager, and plain decode launched ahead (async scheduling)
        engine.runner.decode_graphs = None
        _print_step_row("decode step, eager", ms_per_step(False), plain_ms)
        _print_step_row(f"verify step (1+{k}), eager", ms_per_step(True), plain_ms)
        engine.runner.decode_graphs = graphs
        engine.async_scheduling = True   # plain requests only: nothing is proposed for them
        base_ms = ms_per_step(False)
        _print_step_row("decode step, async scheduling", base_ms, plain_ms)
        engine.async_scheduling = False
    print(f"\n| acceptance per position | tokens per step | effective ms/token | vs plain decode ({base_ms:.3f} ms) |")
    print("|---|---|---|---|")
    for rate in (0.5, 0.7, 0.9):
        per_step = (1 - rate ** (k + 1)) / (1 - rate)
        print(f"| {rate} | {per_step:.2f} | {verify_ms / per_step:.3f} | {verify_ms / per_step / base_ms:.2f}x |")


def _print_step_row(name: str, ms: float, plain_ms: float) -> None:
    print(f"| {name} | {ms:.3f} | {ms / plain_ms:.2f}x |", flush=True)


def _synchronize(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-backoff", action=argparse.BooleanOptionalAction, default=False,
                        help="speculative.prompt_lookup_backoff (default: off)")
    parser.add_argument("--adaptive-length", action=argparse.BooleanOptionalAction, default=True,
                        help="speculative.adaptive_proposal_length (default: on)")
    parser.add_argument("--baseline-ngram", default=None, metavar="MIN-MAX",
                        help="also an ngram engine with these lookup lengths, no backoff and whole matches "
                             "proposed (adaptive_proposal_length off; e.g. 2-4), interleaved with the others")
    parser.add_argument("--draft", default=None, help="a draft model ('default': SmolLM2 drafts for itself)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: the engine's)")
    parser.add_argument("--adaptive-threads", action="store_true",
                        help="let the CPU thread governor pick thread counts per step (its choices change bf16 "
                             "rounding from run to run, so plain runs differ among themselves); default: fixed")
    parser.add_argument("--overhead-shape", default=None,
                        help="skip the real-weights table; measure the verification overhead on a random-weight "
                             "model of this shape (e.g. llama3-8b on cuda)")
    parser.add_argument("--overhead-tokens", type=int, default=128)
    parser.add_argument("--clock", choices=["wall", "cpu", "both"], default="wall",
                        help="cpu: the engine thread's CPU time (a shared machine; needs --num-threads 1); "
                             "both: CPU time and wall time of the same runs, side by side")
    parser.add_argument("--quote-prompts", action="store_true",
                        help="also the older RAG variant: the whole handbook as context, 'quote it word for word'")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's max_num_seqs (fewer CUDA graphs to capture; default: the engine's)")
    parser.add_argument("--cpu-int8-activations", action="store_true",
                        help="EngineConfig.cpu_int8_activations=True (decode/verify steps on int8 activations)")
    args = parser.parse_args(argv)
    if args.clock in ("cpu", "both"):
        if args.num_threads != 1 or args.device != "cpu":
            parser.error(f"--clock {args.clock} needs --device cpu and --num-threads 1 (the forward passes on this "
                         "thread)")
        CLOCK[0] = time.thread_time
    speculative = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.overhead_shape is None:
        real_weights_table(args)
        engine = make_engine(args.model, speculative, args)
    else:
        from .throughput import random_checkpoint

        if args.dtype == "auto":
            args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        started = time.perf_counter()
        _, checkpoint = random_checkpoint(args.overhead_shape, dtype, args.device)
        engine = make_engine(checkpoint.source, speculative, args, checkpoint=checkpoint)
        print(f"{args.overhead_shape} ({args.dtype}, random weights): engine built (CUDA graphs included) in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
    if args.overhead_tokens > 0:  # 0: the real-weights table only
        overhead_table(engine, args.k, args.overhead_tokens, args.repeats)


if __name__ == "__main__":
    main()
