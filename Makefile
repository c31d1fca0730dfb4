# Two commands matter: `make serve` and `make test`. Both install into .venv first; `make test-fast` is the edit loop.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.installed-runtime
DISAGG_STAMP := $(VENV)/.installed-disagg
DYNAMO_STAMP := $(VENV)/.installed-dynamo
STAMP := $(VENV)/.installed

.PHONY: install install-runtime install-disagg install-dynamo test test-fast serve bench clean

# The CPU kernels are built (or found already built) on every install: a build is cached by a hash of its
# sources, compiler and torch, so a checkout whose kernel sources changed gets its own build, and no server ever
# compiles at start. Bytecode for our own sources is written here even where PYTHONDONTWRITEBYTECODE is set (as
# on our machines): without it every vlserve process (a server, its engine, each role) compiles them again
# (~0.3 CPU-s each). Only changed files are compiled again; a stale .pyc is never used (its source's mtime is
# checked). -q: prints only errors (a syntax error names its file).
define finish_install
	@$(PY) -m vlserve.model.kernels.cpu_kernels || echo "vlserve CPU kernels not built: torch fallbacks are used"
	@$(PY) -m compileall -q -j 0 vlserve $(1)
endef

# `make serve` installs what serving needs and nothing more (1.3 GB on a CPU machine, 0.75 GB of it torch):
# the transports' libraries come with `make install-disagg`, and the tests' tools with `make install` (`make
# test`). A role started with a backend whose library is missing says which target installs it.
install-runtime: $(RUNTIME_STAMP)
	$(call finish_install,)

# Everything: the runtime, the transports, the tests' packages and the system tools some tests drive.
install: $(STAMP)
	$(call finish_install,tests)

# torch is pinned and installed first on its own: `pip install torch==2.13.0` takes the CPU wheel on
# CPU-only machines (local wheel cache) and the CUDA build from the index on GPU machines. Installing it
# first keeps the resolver from pulling a newer CUDA torch through a dependency.
$(RUNTIME_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $(RUNTIME_STAMP)

# --transfer-backend mooncake and nixl: their libraries, and Debian's libibverbs1, which Mooncake's engine links
# (RDMA verbs) even for TCP, where we may install it (root + apt).
install-disagg: $(DISAGG_STAMP)
	$(call finish_install,)

$(DISAGG_STAMP): $(RUNTIME_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[disagg]'
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; }; }; } || \
		echo "libibverbs1 missing: --transfer-backend mooncake will not start (apt-get install libibverbs1)"
	touch $(DISAGG_STAMP)

# `vlserve dynamo-worker` (docs/dynamo.md): Dynamo's runtime and Python package, and the NATS server its KV
# router's events travel through (Debian's nats-server, where we may install it; etcd comes with `make install`).
install-dynamo: $(DYNAMO_STAMP)
	$(call finish_install,)

$(DYNAMO_STAMP): $(RUNTIME_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dynamo]'
	$(PY) -m pip install --quiet --no-deps ai-dynamo==1.6.1
	@command -v nats-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq --no-install-recommends nats-server >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends nats-server >/dev/null; }; }; } || \
		echo "nats-server missing: Dynamo's KV events need one (apt-get install nats-server)"
	touch $(DYNAMO_STAMP)

$(STAMP): $(DISAGG_STAMP) $(DYNAMO_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,disagg,dynamo]'
	@# Triton: the CUDA attention path's kernels (vlserve.model.kernels.triton_attention). A CUDA torch brings the
	@# Triton it needs; with a CPU torch the tests run those kernels in Triton's interpreter, on the version the GPU
	@# machines' images carry.
	@$(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && \
		$(PY) -m pip install --quiet triton==3.6.0 || true
	@# Tests of --registry etcd:// start a real etcd (Debian's etcd-server); they skip where it cannot be installed.
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; }; }; } || \
		echo "etcd missing: the etcd registry tests will skip (apt-get install etcd-server)"
	@# tests/test_kubernetes.py renders deploy/kubernetes with kubectl's kustomize v5 (kubectl >= 1.27) and skips
	@# without it. Nothing is installed: the only packaged one, Debian's kubernetes-client, is kubectl 1.20, whose
	@# kustomize is too old for these manifests (and for applying them).
	@command -v kubectl >/dev/null || \
		echo "kubectl missing: tests/test_kubernetes.py will skip its rendering tests (install kubectl >= 1.27)"
	@# The playground's browser test drives the page in Debian's headless chromium; it skips where it cannot be installed.
	@command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }; }; } || \
		echo "chromium missing: the playground browser test will skip (apt-get install chromium chromium-driver)"
	touch $(STAMP)

# Every test has one tier (tests/tiers.py; pyproject.toml registers them as markers), so a run can pick by cost:
#   unit          this process only, no model engine
#   engine        an engine on a tiny checkpoint, in this process
#   multiprocess  vlserve processes: servers, roles, an engine process, tensor-parallel ranks (or a helper process
#                 whose exit or crash is the point)
#   transport     disaggregated roles over each --transfer-backend (the behaviour matrix over zmq; shm, mooncake
#                 and nixl run what is their own: write path, resumes, a peer dying mid-transfer)
# `make test` runs all of them. `make test-fast` runs unit + engine, stopping at the first failure (about 6 minutes
# on 2 busy cores); one tier or a mix: make test ARGS='-m "multiprocess or transport"'.
# Tests run on TEST_WORKERS pytest-xdist workers (2: most multi-process tests wait on their servers half the time),
# a file at a time per worker, so a module's shared cluster starts once; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
# PYTHONDONTWRITEBYTECODE is cleared for the tests (it is set on our machines): with it pytest rewrites the
# asserts of every test module again in each worker (~7 CPU-s a worker), and the processes the tests start
# compile what changed since `make install` again each time. __pycache__ is ignored by git.
TEST_ENV := PYTHONDONTWRITEBYTECODE=
test: install
	$(TEST_ENV) $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-fast: install
	$(TEST_ENV) $(PY) -m pytest tests -m "unit or engine" -x --timeout 120 -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# Extra flags go through ARGS, e.g. make serve ARGS="--model Qwen/Qwen2-VL-2B-Instruct --dtype bfloat16".
# The address: make serve PORT=8001 HOST=0.0.0.0, or the same flags in ARGS (ARGS="--port 8001"); each flag is
# written once (the defaults only when ARGS has none). A PORT or HOST in the environment is not used.
HOST = 127.0.0.1
PORT = 8000
serve_flag_given = $(filter $(1) $(1)=%,$(ARGS))
SERVE_ADDRESS = $(if $(call serve_flag_given,--host),,--host $(HOST)) $(if $(call serve_flag_given,--port),,--port $(PORT))
serve: install-runtime
	$(PY) -m vlserve serve $(strip $(SERVE_ADDRESS) $(ARGS))

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
