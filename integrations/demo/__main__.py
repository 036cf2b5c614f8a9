"""``python -m hearth_llm.integrations.demo``: see the package docstring."""
from . import main

main()
