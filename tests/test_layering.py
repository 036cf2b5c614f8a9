"""Data flows one way: ``engine/`` imports nothing of ``integrations/`` or ``benchmarks/``.

Every module under engine/ is parsed (not imported) and each import it names, relative ones resolved
against the module's own package, is checked against the forbidden packages."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_FOR_ENGINE = ("hearth_llm.integrations", "hearth_llm.benchmarks")


def imported_modules(source: str, package: str) -> set[str]:
    """The absolute names of the modules ``source`` imports, ``package`` being its own package;
    ``importlib.import_module("...")`` with a literal name counts too."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    return names


def is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN_FOR_ENGINE)


def engine_modules():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package_parts = ("hearth_llm",) + (parts if path.name == "__init__.py" else parts[:-1])
        if path.name == "__init__.py":
            package_parts = package_parts[:-1]  # engine/x/__init__.py is the package hearth_llm.engine.x
        yield path, ".".join(package_parts)


def test_the_scanner_sees_absolute_relative_and_importlib_imports():
    source = ("import hearth_llm.integrations.langchain\n"
              "from ...benchmarks import cpu\n"
              "import importlib\nimportlib.import_module('hearth_llm.benchmarks.throughput')\n")
    names = imported_modules(source, "hearth_llm.engine.chat")
    assert {"hearth_llm.integrations.langchain", "hearth_llm.benchmarks.cpu",
            "hearth_llm.benchmarks.throughput"} <= names
    assert all(not is_forbidden(name) for name in imported_modules("from ..loader import gguf", "hearth_llm.engine.x"))


def test_every_engine_module_is_scanned():
    packages = dict((path.relative_to(ROOT).as_posix(), package) for path, package in engine_modules())
    assert packages["engine/llm_engine.py"] == "hearth_llm.engine"
    assert packages["engine/loader/__init__.py"] == "hearth_llm.engine.loader"
    assert len(packages) > 20


@pytest.mark.parametrize("path, package", [pytest.param(path, package, id=path.relative_to(ROOT).as_posix())
                                           for path, package in engine_modules()])
def test_engine_module_imports_no_integrations_or_benchmarks(path, package):
    forbidden = sorted(name for name in imported_modules(path.read_text(encoding="utf-8"), package)
                       if is_forbidden(name))
    assert not forbidden, f"{path.relative_to(ROOT)} imports {forbidden}"
