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
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi

# The daemon's request path again on Python 3.12 (what GPU hosts run): a real
# python3.12 found a 3.12-only bug there (server/eager.py). build/py312 holds
# the package and the test tools; remade when pyproject.toml changes.
py312=""
for c in "${PYTHON312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { py312=$c; break; }
done
if [ -z "$py312" ]; then
  echo "test-python: no python3.12 found (set PYTHON312): the 3.12 run cannot be skipped" >&2
  exit 1
fi
if [ ! -f build/py312/.installed ] || [ pyproject.toml -nt build/py312/.installed ]; then
  echo "test-python: making build/py312 with $("$py312" --version)"
  rm -rf build/py312 && "$py312" -m venv build/py312 &&
    build/py312/bin/pip install -q -e . 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' &&
    touch build/py312/.installed || exit 1
fi
build/py312/bin/python -m pytest -q -p no:cacheprovider tests/test_request_path.py tests/test_elastic.py tests/test_fdchannel.py
rc312=$?
set -e
[ $rc -ne 0 ] && exit $rc
exit $rc312
