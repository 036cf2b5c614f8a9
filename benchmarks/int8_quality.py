"""How far ``cpu_int8_activations=True`` moves the bundled model's answers from the exact path.

    python -m hearth_llm.benchmarks.int8_quality [--prompts 32] [--max-tokens 32]

The quantized-weights issue's quality guard for the int8-activation kernels: the same prompts, greedy,
through the exact engine (the file's weights in the engine's dtype: on an AVX2-only CPU float32, the
dequantized-fp32 reference itself) and through the int8 one, in one process. Reports how many answers
are token-equal, their mean common prefix, and |Δ logprob| of the chosen tokens over the common prefix
(where both saw the same context).
"""
from __future__ import annotations

import argparse

SUBJECTS = ("the kettle's descaling", "express delivery", "error code E1", "the warranty", "a leaking lid",
            "the keep-warm mode", "the filter", "boiling time")
FORMS = ("Explain {} in one sentence.", "Write a short note to a customer about {}.",
         "List three facts about {}.", "What should I know about {}?")


def prompts(count: int) -> list[str]:
    """``count`` distinct chat prompts (subjects x forms, in a fixed order).

    >>> prompts(2)
    ["Explain the kettle's descaling in one sentence.", 'Explain express delivery in one sentence.']
    """
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
    # one chat at a time: the int8 kernels run steps of up to 8 rows (a batch of 32 decodes on the exact path)
    exact_outputs = [exact.chat([chat], greedy, use_tqdm=False)[0] for chat in chats]
    dtype = exact.engine.runner.dtype
    del exact
    int8 = LLM(args.model, show_progress=False, num_threads=args.num_threads, cpu_int8_activations=True)
    int8_outputs = [int8.chat([chat], greedy, use_tqdm=False)[0] for chat in chats]
    equal, mean_prefix = compare([o.outputs[0].token_ids for o in exact_outputs],
                                 [o.outputs[0].token_ids for o in int8_outputs])
    # each chosen token's logprob in both over the answers' common prefix (the same context; decode steps,
    # which the int8 kernels run: scoring an answer as a prompt would take the exact prefill path)
    deltas = []
    for exact_out, int8_out in zip(exact_outputs, int8_outputs):
        a, b = exact_out.outputs[0], int8_out.outputs[0]
        for position, token in enumerate(a.token_ids):
            if position >= len(b.token_ids) or b.token_ids[position] != token:
                break
            deltas.append(abs(a.logprobs[position][token].logprob - b.logprobs[position][token].logprob))
    print(f"{args.model}, {dtype}, int8 kernels: {gguf_cpu_q8x.path()}, {len(texts)} prompts x "
          f"{args.max_tokens} greedy tokens")
    print(f"answers token-equal to the exact path's: {equal}/{len(texts)}; mean common prefix {mean_prefix:.1f} "
          f"tokens; |delta logprob| over the common prefix: max {max(deltas, default=0.0):.3f}, "
          f"mean {sum(deltas) / max(len(deltas), 1):.4f}")


if __name__ == "__main__":
    main()
