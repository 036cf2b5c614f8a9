"""How far ``cpu_int8_activations=True`` moves the bundled model's answers from the exact path.

    python -m hearth_llm.benchmarks.int8_quality [--prompts 32] [--max-tokens 32]

The quantized-weights issue's quality guard for the int8-activation kernels: the same prompts, greedy,
through the exact engine (the file's weights in the engine's dtype: on an AVX2-only CPU float32, the
dequantized-fp32 reference itself) and through the int8 one, in one process. Reports how many answers
are token-equal, their mean common prefix, and |Δ logprob| of the exact answer's tokens (the int8
engine scores the exact answer as a prompt, so every position compares the same context).
"""
from __future__ import annotations

import argparse

SUBJECTS = ("the kettle's descaling", "express delivery", "error code E1", "the warranty", "a leaking lid",
            "the keep-warm mode", "the filter", "boiling time")
FORMS = ("Explain {} in one sentence.", "Write a short note to a customer about {}.",
         "List three facts about {}.", "What should I know about {}?")


def prompts(count: int) -> list[str]:
    """``count`` distinct chat prompts (subjects x forms, in a fixed order)."""
    made = [form.format(subject) for form in FORMS for subject in SUBJECTS]
    if count > len(made):
        raise ValueError(f"--prompts must be at most {len(made)}, got {count}")
    return made[:count]


def compare(exact_ids: list[list[int]], int8_ids: list[list[int]]) -> tuple[int, float]:
    """(answers token-equal, mean common prefix length in tokens).

    >>> compare([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    (1, 2.0)
    """
    def prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    equal = sum(a == b for a, b in zip(exact_ids, int8_ids))
    return equal, sum(prefix(a, b) for a, b in zip(exact_ids, int8_ids)) / len(exact_ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)

    from hearth_llm.engine import LLM, SamplingParams
    from hearth_llm.kernels.quant import gguf_cpu_q8x

    texts = prompts(args.prompts)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    exact = LLM(args.model, show_progress=False, num_threads=args.num_threads)
    chats = [[{"role": "user", "content": text}] for text in texts]
    exact_outputs = exact.chat(chats, greedy, use_tqdm=False)
    dtype = exact.engine.runner.dtype
    del exact
    int8 = LLM(args.model, show_progress=False, num_threads=args.num_threads, cpu_int8_activations=True)
    int8_outputs = int8.chat(chats, greedy, use_tqdm=False)
    equal, mean_prefix = compare([o.outputs[0].token_ids for o in exact_outputs],
                                 [o.outputs[0].token_ids for o in int8_outputs])
    # the exact answers scored by the int8 engine, position by position
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    deltas = []
    for out in exact_outputs:
        answer = out.outputs[0].token_ids
        scored = int8.generate([out.prompt_token_ids + answer], score, use_tqdm=False)[0]
        tail = scored.prompt_logprobs[len(out.prompt_token_ids):]
        for token, exact_lp, int8_lp in zip(answer, out.outputs[0].logprobs, tail):
            deltas.append(abs(exact_lp[token].logprob - int8_lp[token].logprob))
    print(f"{args.model}, {dtype}, int8 kernels: {gguf_cpu_q8x.path()}, {len(texts)} prompts x "
          f"{args.max_tokens} greedy tokens")
    print(f"answers token-equal to the exact path's: {equal}/{len(texts)}; mean common prefix {mean_prefix:.1f} "
          f"tokens; |delta logprob| of the exact tokens: max {max(deltas):.3f}, mean {sum(deltas) / len(deltas):.4f}")


if __name__ == "__main__":
    main()
