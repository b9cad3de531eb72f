# kvcached-service: two commands for a fresh machine.
#   make serve   set up, then run the daemon on /tmp/kvcached.sock
#   make test    set up, then run every test suite (Python, Go, C, llama.cpp, Ollama, GPU bundle dry run, fuzzing)
SOCKET ?= /tmp/kvcached.sock
ARGS ?=

.PHONY: serve test setup testdriver test-python test-go test-c test-packaging test-llama test-ollama test-gpu-bundle test-fuzz

# PREFLIGHT: the suites the target asked for; scripts/preflight.sh checks in
# seconds what they need that set-up cannot install (root, python3.12, Go,
# bookworm sources) and stops before set-up downloads anything.
# GO_WANT: the least Go those suites need; set-up installs one from the Go
# module proxy when the PATH has none as new (scripts/install-go.sh).
PREFLIGHT ?=
GO_WANT ?=
setup:
	@scripts/preflight.sh $(PREFLIGHT)
	@KVC_GO_WANT=$(GO_WANT) scripts/setup.sh --dev
	@scripts/setup-ops.sh

test: PREFLIGHT = all
test-python: PREFLIGHT = python
test-go: PREFLIGHT = go
test-c: PREFLIGHT = c
test-packaging: PREFLIGHT = packaging
test-llama: PREFLIGHT = llama
test-ollama: PREFLIGHT = ollama
test-gpu-bundle: PREFLIGHT = gpu-bundle
test-fuzz: PREFLIGHT = fuzz
test test-ollama: GO_WANT = 1.26
test-go test-fuzz: GO_WANT = 1.24

serve:
	@scripts/setup.sh
	.venv/bin/kvcached-serve --socket $(SOCKET) $(ARGS)

testdriver: setup
	@scripts/build-testdriver.sh

test-python: setup testdriver
	scripts/test-python.sh

test-go: setup testdriver
	scripts/test-go.sh

test-c: setup testdriver
	scripts/test-c.sh

test-packaging: setup testdriver
	scripts/test-packaging.sh

test-llama: setup testdriver
	scripts/test-llama.sh

test-ollama: setup testdriver
	scripts/test-ollama.sh

test-gpu-bundle: setup testdriver
	scripts/test-gpu-bundle.sh

test-fuzz: setup
	scripts/test-fuzz.sh

test: setup testdriver
	scripts/test-all.sh
