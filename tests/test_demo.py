"""``make demo`` in its short form: one RAG question streamed through LangChain, the same question
through LlamaIndex, one agent tool call, and the engine's stats line, all on one engine."""
import re

import pytest

pytest.importorskip("langchain.agents", reason="the demo's agent needs langchain (the dev extra)")
pytest.importorskip("llama_index.core", reason="the demo needs llama-index-core (the dev extra)")

from hearth_llm.integrations import demo  # noqa: E402


def test_corpus_ships_with_the_package():
    pages = demo.load_corpus()
    assert 8 <= len(pages) <= 12 and all(name.endswith(".md") and text.strip() for name, text in pages)


def test_short_demo_streams_answers_calls_the_tool_and_reports_stats(capsys):
    demo.main(["--questions", "1", "--max-tokens", "40"])
    out = capsys.readouterr().out
    question = demo.QUESTIONS[0]
    langchain_part, llama_index_part = out.split("LlamaIndex query engine", 1)
    answer = langchain_part.split(f"Q: {question}\nA: ", 1)[1].split("\n", 1)[0]
    assert len(answer.split()) >= 3, out                   # its wording depends on the CPU's float rounding
    assert f"Q: {question}" in llama_index_part and "(retrieved: 04-descaling.md)" in llama_index_part
    assert "Tool call: celsius_to_fahrenheit({'celsius': 80" in out and "Tool result: 176.0" in out
    stats = re.search(r"stats: (\d+) tokens generated in .* tok/s \| prefix-cache hit rate (\d+)% .* \| "
                      r"requests batched together: up to (\d+) per step", out)
    assert stats, out[-500:]
    assert int(stats.group(1)) > 0 and int(stats.group(2)) > 0 and int(stats.group(3)) >= 1
