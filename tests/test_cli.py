"""The command line as a person uses it: a chat typed under a pseudo-terminal, info, generate."""
import json
import os
import pty
import select
import subprocess
import sys
import time


def read_until(fd, marker: str, timeout: float = 120) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out waiting for {marker!r}; screen so far: {seen[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            seen += os.read(fd, 4096).decode(errors="replace")
    return seen


def test_chat_under_a_pty_streams_answers_and_keeps_history():
    main_fd, child_fd = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "hearth_llm.engine.cli", "chat", "--max-tokens", "24"],
                               stdin=child_fd, stdout=child_fd, stderr=child_fd, close_fds=True)
    os.close(child_fd)
    try:
        read_until(main_fd, "you> ")
        os.write(main_fd, b"What is the capital of France?\n")
        first = read_until(main_fd, "you> ")
        assert "Paris" in first
        os.write(main_fd, b"Repeat the city you just named.\n")
        second = read_until(main_fd, "you> ")
        assert "assistant> " in second and "Paris" in second  # the answer drew on the history
        os.write(main_fd, b"/reset\n")
        assert "history cleared" in read_until(main_fd, "you> ")
        os.write(main_fd, b"/exit\n")
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        os.close(main_fd)


def test_info_reports_model_and_capacity():
    out = subprocess.run([sys.executable, "-m", "hearth_llm.engine.cli", "info"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    info = json.loads(out)
    assert info["architecture"] == "LlamaForCausalLM" and info["kv_capacity_tokens"] > 0


def test_generate_writes_jsonl(tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("What is the capital of France?\nName a color.\n")
    target = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "hearth_llm.engine.cli", "generate", str(source), "-o", str(target),
                    "--chat", "--max-tokens", "12"], capture_output=True, text=True, timeout=180, check=True)
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["What is the capital of France?", "Name a color."]
    assert "Paris" in records[0]["text"]
