"""The ``hearth-llm`` script: the engine's commands (``hearth_llm.engine.cli``), ``bench``
(``hearth_llm.benchmarks.cli``) and ``serve`` (``hearth_llm.server.cli``). It sits above them, so the
engine never imports the benchmarks or the server.

    hearth-llm chat                  # or: python -m hearth_llm.cli chat
    hearth-llm bench cpu --help
    hearth-llm serve default --port 8000
"""
from __future__ import annotations

from hearth_llm.benchmarks.cli import add_bench_command
from hearth_llm.engine.cli import build_parser, run
from hearth_llm.server.cli import add_serve_command


def main(argv: list[str] | None = None) -> None:
    """Runs one ``hearth-llm`` command; ``argv`` defaults to the process's arguments.

    >>> main(["info"])  # doctest: +SKIP
    """
    parser, commands = build_parser()
    add_bench_command(commands)
    add_serve_command(commands)
    run(parser, argv)
