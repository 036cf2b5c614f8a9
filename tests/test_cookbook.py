"""The cookbook notebooks run top to bottom, offline, on the default models, each in a fresh kernel
of this interpreter; each ends by asserting its own result."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the cookbook tests need nbformat (the dev extra)")
nbclient = pytest.importorskip("nbclient", reason="the cookbook tests need nbclient (the dev extra)")
pytest.importorskip("ipykernel", reason="the cookbook tests need ipykernel (the dev extra)")

from ipykernel.kernelspec import write_kernel_spec  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"
NOTEBOOKS = sorted(COOKBOOK.glob("*.ipynb"))
KERNEL_NAME = "hearth-cookbook"
# Each notebook takes 10-20 s alone on a 2-core CPU; the bounds leave room for a busy machine.
CELL_TIMEOUT_S = 90
NOTEBOOK_TIMEOUT_S = 180
# Text each notebook prints when it worked; the notebooks' own assert cells check the rest.
EXPECTED_OUTPUT = {
    "01_rag_langchain": "Paris",
    "02_langchain_agent": "391",
    "03_rag_llama_index": "Berlin",
    "04_llama_index_agent": "tool multiply({'a': 6, 'b': 7}) -> 42",
    "05_offline_batch": "prefix cache hit rate",
    "06_structured_extraction": "Person(name=",
    "07_shared_engine_concurrency": "chunks, done at",
}


@pytest.fixture(scope="session")
def kernel_specs(tmp_path_factory) -> KernelSpecManager:
    """A kernel spec that starts ipykernel on this very interpreter (not whatever `python` is on PATH)."""
    specs = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(str(specs / KERNEL_NAME))
    return KernelSpecManager(kernel_dirs=[str(specs)])


def run_notebook(path: Path, kernel_specs: KernelSpecManager, cwd: Path):
    """Execute ``path`` in a fresh kernel; each cell gets at most what is left of the notebook's time."""
    notebook = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S

    def cell_timeout(cell) -> int:
        return max(1, int(min(CELL_TIMEOUT_S, deadline - time.monotonic())))

    # nbclient only enforces cell timeouts with an async kernel manager (a blocking one waits forever).
    kernel = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_specs)
    client = nbclient.NotebookClient(notebook, km=kernel, timeout_func=cell_timeout,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return notebook


def printed_text(notebook) -> str:
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                texts.append(output.text)
            elif output.output_type in ("execute_result", "display_data"):
                texts.append(output.data.get("text/plain", ""))
    return "\n".join(texts)


def test_the_cookbook_has_notebooks():
    assert NOTEBOOKS, f"no notebooks in {COOKBOOK}: the notebook tests below would pass by running nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.cells[0].cell_type == "markdown" and "pip install" in notebook.cells[0].source
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)
    assert "assert " in code_cells[-1].source, "the last code cell should check the notebook's result"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs_offline_to_its_final_asserts(path, kernel_specs, tmp_path, monkeypatch):
    # The kernel inherits this environment: no hub downloads, and OpenMP threads that do not spin.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    started = time.monotonic()
    notebook = run_notebook(path, kernel_specs, tmp_path)  # raises CellExecutionError on any failing cell
    print(f"{path.name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert all(cell.execution_count is not None for cell in notebook.cells if cell.cell_type == "code")
    expected = EXPECTED_OUTPUT.get(path.stem)
    if expected is not None:
        assert expected in printed_text(notebook)
