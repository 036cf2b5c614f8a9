"""``hearth-llm bench gguf-cpu``: the table's ratios and memory figures, and the prompts both engines get
(no llama.cpp, no model: the numbers are made up here)."""
from __future__ import annotations

from hearth_llm.benchmarks import gguf_cpu
from hearth_llm.benchmarks.gguf_cpu import LLAMA_CPP, SystemResult, format_table, ratio, requests_for, table_rows
from hearth_llm.benchmarks.gguf_files import LLAMA_1B


def _results():
    return {LLAMA_CPP: SystemResult({"single": [20.0, 25.0], "prefill": [100.0], "concurrent": [25.0]},
                                    rss_bytes=110 * 2**20, load_s=0.4,
                                    rss_before_load=10 * 2**20),
            "hearth": SystemResult({"single": [30.0, 20.0], "prefill": [300.0], "concurrent": [200.0]},
                                   rss_bytes=400 * 2**20, load_s=2.0,
                                   rss_before_load=300 * 2**20)}


def test_each_row_shows_the_best_repeat_and_its_ratio_to_llama_cpp():
    rows = dict((row[0], row) for row in table_rows(_results(), file_bytes=100 * 2**20))
    assert rows["hearth"][1:4] == ["30.0 (1.20x)", "300.0 (3.00x)", "200.0 (8.00x)"]
    assert rows[LLAMA_CPP][1:4] == ["25.0", "100.0", "25.0"]  # the peer gets no ratio to itself


def test_memory_is_resident_bytes_over_the_file_size():
    rows = dict((row[0], row) for row in table_rows(_results(), file_bytes=100 * 2**20))
    assert rows["hearth"][4:6] == ["400 MiB (4.00x file)", "100 MiB (1.00x file)"]
    assert rows[LLAMA_CPP][4:6] == ["110 MiB (1.10x file)", "100 MiB (1.00x file)"]


def test_without_llama_cpp_there_are_no_ratios_and_missing_measures_show_a_dash():
    rows = table_rows({"hearth": SystemResult({"single": [12.5]}, rss_bytes=2**20)}, file_bytes=2**20)
    assert rows == [["hearth", "12.5", "-", "-", "1 MiB (1.00x file)", "1 MiB (1.00x file)", "0.0"]]
    assert ratio(1.0, None) is None and ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_the_table_is_markdown_with_one_line_per_system():
    text = format_table("title", table_rows(_results(), file_bytes=2**20))
    lines = text.splitlines()
    assert lines[0] == "### title" and len(lines) == 3 + 2
    assert all(line.count("|") == len(gguf_cpu.HEADER) + 1 for line in lines[1:])


def test_every_system_gets_the_same_prompts_and_each_repeat_new_ones():
    first, again, next_repeat = (requests_for("prefill", r, 32000, 8) for r in (0, 0, 1))
    assert first == again and first["prompt"] != next_repeat["prompt"]
    assert len(first["prompt"]) == gguf_cpu.PREFILL_TOKENS
    chats = requests_for("concurrent", 0, 49152, 8)["prompts"]
    assert len(chats) == gguf_cpu.NUM_CONCURRENT and len({tuple(p) for p in chats}) == gguf_cpu.NUM_CONCURRENT
    assert all(16 <= token < 49152 for prompt in chats for token in prompt)


def test_the_1b_shape_has_about_a_billion_parameters():
    assert 1.0e9 <= LLAMA_1B.num_parameters <= 1.2e9


def test_the_no_amx_system_runs_a_worker_with_amx_batches_off():
    from pathlib import Path

    from hearth_llm.benchmarks.gguf_cpu import parse_args, worker_commands

    args = parse_args(["--systems", "hearth,hearth no-amx", "--skip-llama-cpp"])
    commands = worker_commands(Path("model.gguf"), 1, args)
    assert set(commands) == {"hearth", "hearth no-amx"}
    assert "--no-amx" in commands["hearth no-amx"] and "--no-amx" not in commands["hearth"]
    assert parse_args(commands["hearth no-amx"][2:]).no_amx
