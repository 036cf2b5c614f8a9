"""Benchmarks against peers, the README's comparison numbers; scripts, not tests.

Run them as ``hearth-llm bench NAME`` (``cli.py``) or ``python -m hearth_llm.benchmarks.NAME``. They sit
above the engine, the embeddings and the integrations and may import all three; none of those
imports this package.
"""
