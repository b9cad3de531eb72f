# kvcached-service: two commands for a fresh machine.
#   make serve   set up, then run the daemon on /tmp/kvcached.sock
#   make test    set up, then run every test suite (Python, Go, C)
SOCKET ?= /tmp/kvcached.sock
ARGS ?=

.PHONY: serve test setup testdriver test-python test-go test-c

setup:
	@scripts/setup.sh
	@scripts/setup-ops.sh

serve: setup
	.venv/bin/kvcached-serve --socket $(SOCKET) $(ARGS)

testdriver: setup
	@scripts/build-testdriver.sh

test-python: setup testdriver
	scripts/test-python.sh

test-go: setup testdriver
	scripts/test-go.sh

test-c: setup testdriver
	scripts/test-c.sh

test: setup testdriver
	scripts/test-python.sh
	scripts/test-go.sh
	scripts/test-c.sh
