"""ChatHearth and HearthLLM pass ``speculative=`` through to the shared engine's config."""
import pytest

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_chat_hearth_passes_speculative_to_the_engine(monkeypatch):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import HumanMessage

    from hearth_llm.integrations.langchain import chat_models

    asked = {}

    def fake_get_engine(model, **kwargs):
        asked.update(kwargs, model=model)
        raise RuntimeError("stop here: only the engine's arguments are checked")

    monkeypatch.setattr(chat_models, "get_engine", fake_get_engine)
    chat = chat_models.ChatHearth(speculative=NGRAM, engine_kwargs={"max_num_seqs": 4})
    with pytest.raises(RuntimeError, match="stop here"):
        chat._prepare([HumanMessage("hi")], None, {})
    assert asked["speculative"] == NGRAM and asked["max_num_seqs"] == 4


def test_hearth_llm_engine_config_has_the_speculative_config():
    pytest.importorskip("llama_index.core")
    from hearth_llm.integrations.llama_index import HearthLLM

    core = HearthLLM(speculative=NGRAM).core  # made, not loaded
    assert core.config.speculative.method == "ngram" and core.config.speculative.num_speculative_tokens == 3
