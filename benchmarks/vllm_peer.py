"""vLLM as the peer of ``bench throughput --vllm``: started in a subprocess, compared by ratios.

vLLM never enters our process (its torch.compile and CUDA state would share ours): this module
only finds an interpreter that can import it, runs :mod:`.vllm_side` there with the same shape,
workloads and options, and reads back its JSON. :func:`format_ratio_table` puts both sides' measures
side by side, every ratio written so that > 1 means ours is faster.

>>> env = vllm_environment("/tmp/vsite")
>>> problem = vllm_unavailable("python3", env)   # None when that interpreter can import vLLM
>>> peer = run_vllm_side("python3", env, ["--shape", "llama3-8b"], "/tmp/vllm.json")  # doctest: +SKIP
>>> print(format_ratio_table(ours_measures, peer["measures"], "llama3-8b"))  # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
import subprocess

# (key, label, which way is better, goal as a ratio ours-faster-by), as issue 22 states them.
MEASURES = (
    ("throughput_tok_s", "throughput (256 seqs), tok/s", "higher", 1.2),
    ("bs1_ms_per_token", "bs1 decode, ms/token", "lower", None),
    ("prefix_burst_cold_s", "shared-prefix burst, never seen, s", "lower", 1.0),
    ("prefix_burst_warm_s", "shared-prefix burst, warmed, s", "lower", 1.0),
    ("long_context_s", "long-context mix, s", "lower", 1.1),
)
BS1_GOAL_MS = {"llama3-8b": 4.15, "qwen3-0.6b": 1.0}
_CHECK = ("import importlib.util, sys; missing = [m for m in ('vllm', 'hearth_llm.benchmarks.vllm_side') "
          "if importlib.util.find_spec(m) is None]; print(' '.join(missing)); sys.exit(3 if missing else 0)")


class VLLMUnavailable(RuntimeError):
    """vLLM cannot run here (not importable by the interpreter, or its run failed); the message says why."""


def vllm_environment(pythonpath: str | None = None, base: dict | None = None) -> dict:
    """The subprocess's environment: ``pythonpath`` first on ``PYTHONPATH`` (where vLLM was unpacked),
    ``VLLM_USE_FLASHINFER_SAMPLER=0`` unless set (flashinfer is not in the bundle)."""
    env = dict(os.environ if base is None else base)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(part for part in (pythonpath, env.get("PYTHONPATH")) if part)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def vllm_unavailable(python: str, env: dict) -> str | None:
    """None if ``python`` with ``env`` can import vLLM and our vLLM side; else what is missing."""
    try:
        done = subprocess.run([python, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python!r}: {error}"
    if done.returncode == 0:
        return None
    missing = done.stdout.strip() or (done.stderr.strip().splitlines() or ["it failed"])[-1]
    return (f"{python} (PYTHONPATH={env.get('PYTHONPATH', '')!r}) cannot import: {missing}. Pass --vllm-pythonpath "
            "DIR where vLLM is unpacked (on the GPU machine: /tmp/vsite) or --vllm-python PYTHON")


def run_vllm_side(python: str, env: dict, arguments: list[str], json_path: str, timeout: float = 1800) -> dict:
    """Run :mod:`.vllm_side` with ``arguments`` (plus ``--json json_path``); its results, or
    :class:`VLLMUnavailable` with the end of its output."""
    problem = vllm_unavailable(python, env)
    if problem is not None:
        raise VLLMUnavailable(problem)
    command = [python, "-m", "hearth_llm.benchmarks.vllm_side", *arguments, "--json", json_path]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise VLLMUnavailable(f"vLLM's side ran past {timeout:.0f} s") from error
    if done.returncode != 0 or not os.path.exists(json_path):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise VLLMUnavailable(f"vLLM's side exited with {done.returncode}:\n{tail}")
    with open(json_path) as source:
        return json.load(source)


def ratio(key: str, ours: float, peer: float) -> float:
    """> 1 when ours is faster: ours/peer for rates, peer/ours for times."""
    better = next(way for name, _, way, _ in MEASURES if name == key)
    return ours / peer if better == "higher" else peer / ours


def format_ratio_table(ours: dict, peer: dict, shape: str, peer_name: str = "vLLM") -> str:
    """Both sides' measures and the ratios (> 1: ours faster), with each goal met or not; measures
    only one side has are left out."""
    lines = [f"{'measure (' + shape + ')':<42}{'ours':>14}{peer_name:>14}{'ratio':>9}   goal"]
    for key, label, _, goal in MEASURES:
        if key not in ours or key not in peer:
            continue
        value = ratio(key, ours[key], peer[key])
        verdict = "" if goal is None else f">= {goal:.1f}x {'met' if value >= goal else 'NOT met'}"
        lines.append(f"{label:<42}{_number(ours[key]):>14}{_number(peer[key]):>14}{value:>8.2f}x   {verdict}")
    if "bs1_ms_per_token" in ours and shape in BS1_GOAL_MS:
        goal = BS1_GOAL_MS[shape]
        lines.append(f"bs1 decode goal <= {goal} ms/token: {ours['bs1_ms_per_token']:.3f} "
                     f"{'met' if ours['bs1_ms_per_token'] <= goal else 'NOT met'}")
    return "\n".join(lines)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"
