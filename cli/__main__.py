"""``python -m hearth_llm.cli``: the ``hearth-llm`` script."""
from . import main

main()
