"""The ``hearth-llm`` script: the engine's commands (``hearth_llm.engine.cli``) and ``bench``
(``hearth_llm.benchmarks.cli``). It sits above both, so the engine never imports the benchmarks.

    hearth-llm chat                  # or: python -m hearth_llm.cli chat
    hearth-llm bench cpu --help
"""
from __future__ import annotations

from hearth_llm.benchmarks.cli import add_bench_command
from hearth_llm.engine.cli import build_parser, run


def main(argv: list[str] | None = None) -> None:
    """Runs one ``hearth-llm`` command; ``argv`` defaults to the process's arguments.

    >>> main(["info"])  # doctest: +SKIP
    """
    parser, commands = build_parser()
    add_bench_command(commands)
    run(parser, argv)
