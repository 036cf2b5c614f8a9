"""Benchmark scripts (run with ``python -m hearth_llm.engine.bench.<name>``); not tests."""
