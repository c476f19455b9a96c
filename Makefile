# compactproxy: `make test` is the one command CI runs (.ci/run).

GO       ?= go
BIN      ?= bin/compactproxy
IMAGE    ?= compactproxy
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS  := -s -w -X main.version=$(VERSION)

.PHONY: all build run test llama-matrix agent-matrix e2e-deps agent-deps ops-deps redis-deps bench bench-go bench-load bench-profile soak lint docker clean help

all: lint test build

help:
	@echo "make all       lint, test and build"
	@echo "make build     static binary in $(BIN) (CGO off, -trimpath, version $(VERSION))"
	@echo "make run       go run ./cmd/compactproxy on 127.0.0.1:8081 (upstream: llama-server at http://127.0.0.1:8080/v1 unless COMPACTPROXY_UPSTREAM_URL is set)"
	@echo "make test      e2e dependencies + go test -race -count=1 ./... (what CI runs)"
	@echo "make e2e-deps  the end-to-end tests' npm packages (npm ci from test/e2e's lockfile)"
	@echo "make agent-deps  the real-agent test's agent CLIs (npm ci from test/agent's lockfile)"
	@echo "make ops-deps  promtool and prometheus (apt-get install prometheus) for test/ops"
	@echo "make redis-deps  redis-server (apt-get install redis-server) for the store tests"
	@echo "make agent-matrix  the real-agent test's whole matrix, opencode's and Codex/Claude Code's large reads and the token-economy report included (not part of make test)"
	@echo "make llama-matrix  the wide real llama-server matrix, 2k-32k, LLAMA_RUNS runs each (not part of make test)"
	@echo "make bench     bench-go + bench-load (not part of make test)"
	@echo "make bench-go  go test benchmarks of the parse and rewrite path"
	@echo "make bench-load  the load harness: mock upstream, bare proxy, compactproxy"
	@echo "make bench-profile  pprof CPU profile of compactproxy under the harness (PROFILE_SCENARIO, PROFILE_CONCURRENCY)"
	@echo "make soak      1,000 streams for 60 s, direct vs through compactproxy (not part of make test)"
	@echo "make lint      gofmt check + go vet"
	@echo "make docker    docker build -t $(IMAGE):$(VERSION) -t $(IMAGE):latest ."
	@echo "make clean     remove bin/"
	@echo "make help      this list"

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/compactproxy

# Serves on 127.0.0.1:8081 (loopback only; ARGS=--listen=:8081 for every
# interface). Needs nothing: upstream.url defaults to llama-server's own address,
# http://127.0.0.1:8080/v1 (the start-up log line says which upstream is used,
# /readyz whether it answers). Another upstream:
#   COMPACTPROXY_UPSTREAM_URL=https://api.openai.com/v1 make run
# Reads ./configs/compactproxy.yaml (all defaults) when run from the checkout.
run:
	$(GO) run ./cmd/compactproxy $(ARGS)

# Installs what the end-to-end tests need (the official openai npm SDK, from
# a committed lockfile) before the Go tests run; they drive the real binary.
e2e-deps:
	./scripts/e2e-deps.sh

# test/llama runs compactproxy against a real llama-server. CI (and any
# checkout with ../shared/llama beside it) gets the binary, model and chat
# templates from there; elsewhere set LLAMA_SERVER_BIN / LLAMA_MODEL
# (docs/testing.md, "test/llama: a real llama-server"), else those tests skip.
LLAMA_DIR ?= ../shared/llama
export LLAMA_SERVER_BIN ?= $(abspath $(wildcard $(LLAMA_DIR)/llama-server))
export LLAMA_MODEL ?= $(abspath $(wildcard $(LLAMA_DIR)/models/stories260K.gguf))
export LLAMA_TEMPLATES_DIR ?= $(abspath $(wildcard $(LLAMA_DIR)/templates))
export LLAMA_MODELS_DIR ?= $(abspath $(wildcard $(LLAMA_DIR)/models))

# Installs the real-agent test's agent CLIs (the pi coding agent, qwen-code
# and, on linux-x64, the binaries of opencode, Codex CLI, Claude Code and the
# Node 22 qwen-code runs with, from test/agent/package-lock.json); test/agent
# drives them through the binary.
agent-deps:
	./scripts/agent-deps.sh

# Installs promtool and prometheus (Debian's prometheus package) for test/ops.
ops-deps:
	./scripts/ops-deps.sh

# redis-server (Debian's package) for the store tests; each test starts its
# own on a free loopback port.
redis-deps:
	./scripts/redis-deps.sh

# test/llama runs its short matrix here: every loop goes its 40 steps
# whatever the machine's speed (nothing is cut short by a time budget), so only
# behaviour can fail it; -timeout 30m is the hang guard.
test: e2e-deps agent-deps ops-deps redis-deps
	$(GO) test -race -count=1 -timeout 30m ./...

# Not part of `make test`: the wide real llama-server matrix (every window ×
# template × workload, stories260K and the real-tokenizer models at 8k-32k,
# the Responses and Messages loops through the npm SDKs e2e-deps installs,
# LLAMA_RUNS runs each, default 3), its report in LLAMA_REPORT
# (default llama-matrix.txt). Takes an hour or more on 2 cores.
llama-matrix: e2e-deps
	LLAMA_MATRIX=full LLAMA_RUNS=$${LLAMA_RUNS:-3} LLAMA_REPORT=$${LLAMA_REPORT:-$(CURDIR)/llama-matrix.txt} \
		$(GO) test -count=1 -timeout 600m -run TestLlamaAgentLoop -v ./test/llama/

# Not part of `make test`: test/agent's whole matrix, pi and opencode over
# both workloads at 16k and 32k (make test runs all but opencode's
# large_reads), qwen-code at 16k and 32k (make test runs both), Codex CLI and
# Claude Code at 40k with larger reads too (make test runs one read size
# each). Run as root on linux-x64 for opencode, qwen-code, Codex and Claude
# Code (they run in network namespaces of their own). With them the
# token-economy report (TestAgentEconomy: five agents x two workloads x a
# tight and a roomy window, direct and through compactproxy), appended to
# AGENT_REPORT (default agent-report.md).
agent-matrix: agent-deps
	AGENT_MATRIX=1 AGENT_REPORT=$${AGENT_REPORT:-$(CURDIR)/agent-report.md} \
		$(GO) test -count=1 -timeout 90m -v -run 'TestRealAgentThroughCompactproxy|TestCodexAndClaudeCode|TestAgentEconomy' ./test/agent/

# Not part of `make test`. bench-go: go test benchmarks (parse and rewrite
# path); bench-load: the load harness (mock upstream, bare proxy, compactproxy;
# figures as ratios measured in one run, see bench/run.sh for its knobs).
bench: bench-go bench-load

bench-go:
	$(GO) test -run='^$$' -bench=. -benchmem ./internal/...

bench-load:
	./bench/run.sh

# CPU profile of the real binary (built with -tags pprof) under the load
# harness at one scenario and concurrency; see bench/profile.sh for knobs.
bench-profile:
	./bench/profile.sh

# Not part of `make test`: long-running load, see bench/soak.sh.
soak:
	./bench/soak.sh

lint:
	@out="$$(find . -name '*.go' -not -path './.git/*' -not -path '*/node_modules/*' -print0 | xargs -0 gofmt -l)"; \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

docker:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION) -t $(IMAGE):latest .

clean:
	rm -rf bin
