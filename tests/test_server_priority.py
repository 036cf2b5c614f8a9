"""A request's ``priority`` field reaches the engine's scheduler (lower runs first), on both
endpoints. The bundled model (its chat template), on the session's engine settings."""
from __future__ import annotations

import httpx

from hearth_llm.server import start_server


def test_the_priority_field_of_both_endpoints_is_the_engines_request_priority(monkeypatch):
    with start_server("default", embedding_model=None, served_model_name="tiny", dtype="float32") as running:
        core = running.app.state.hearth.core
        seen = []
        add_requests = core.add_requests

        def spy(prompts, sampling_params, request_ids=None, priorities=None, *args, **kwargs):
            seen.append(list(priorities))
            return add_requests(prompts, sampling_params, request_ids, priorities, *args, **kwargs)

        monkeypatch.setattr(core, "add_requests", spy)  # add_request (the chat path) calls it too
        completion = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True, "priority": -3}
        assert httpx.post(f"{running.url}/completions", json=completion, timeout=60).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 7}
        assert httpx.post(f"{running.url}/chat/completions", json=chat, timeout=60).status_code == 200
        default = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2}
        assert httpx.post(f"{running.url}/completions", json=default, timeout=60).status_code == 200
    assert seen == [[-3], [7], [0]]
