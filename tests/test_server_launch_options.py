"""``hearth-llm serve``'s process-level options (no server is started)."""
from __future__ import annotations

import sys

import pytest

from hearth_llm.engine.cli import build_parser
from hearth_llm.server import launch
from hearth_llm.server.cli import add_serve_command, serve_kwargs


def test_switch_interval_reaches_serve_only_when_given():
    parser, commands = build_parser()
    add_serve_command(commands)
    assert "switch_interval" not in serve_kwargs(parser.parse_args(["serve"]))  # Python's own default
    assert serve_kwargs(parser.parse_args(["serve", "--switch-interval", "0.0005"]))["switch_interval"] == 0.0005


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_switch_interval_that_is_not_positive_is_refused_before_anything_changes(bad, monkeypatch):
    monkeypatch.setattr(launch, "create_app", lambda *a, **k: pytest.fail("the app must not be built"))
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match="switch_interval"):
        launch.serve("default", switch_interval=bad)
    assert sys.getswitchinterval() == before


def test_serve_sets_the_switch_interval_before_it_builds_the_app(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "create_app", lambda *a, **k: seen.append(sys.getswitchinterval()) or object())
    monkeypatch.setattr(launch, "_HeapFreezingServer", lambda config: type("S", (), {"run": lambda self: None})())
    monkeypatch.setattr(launch.uvicorn, "Config", lambda *a, **k: None)
    before = sys.getswitchinterval()
    try:
        launch.serve("default", switch_interval=0.0007)
        assert seen and abs(seen[0] - 0.0007) < 1e-9
    finally:
        sys.setswitchinterval(before)


def test_the_served_process_freezes_its_heap_once_the_app_started(monkeypatch):
    import asyncio
    import gc

    calls = []
    monkeypatch.setattr(launch.uvicorn.Server, "startup", lambda self, sockets=None: _noop(calls))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    server = launch._HeapFreezingServer(launch.uvicorn.Config(app=None))
    asyncio.run(server.startup())
    assert calls == ["started", "freeze"]  # after the app's start (the model load), not before


async def _noop(calls: list) -> None:
    calls.append("started")
