#!/usr/bin/env bash
# The Python test suite (daemon, Python client, CUDA backend on the test driver,
# operations, benchmarks in quick mode).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
set +e
# tests/llama needs llama-server builds: scripts/test-llama.sh runs it;
# tests/packaging needs the sdist, wheel and image: scripts/test-packaging.sh;
# tests/ollama needs the Ollama builds: scripts/test-ollama.sh.
.venv/bin/python -m pytest tests --ignore=tests/llama --ignore=tests/packaging --ignore=tests/ollama "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit $rc
