"""Fixtures for the e2e tests: one real llama-cpp-python server with Gemma 3 270M per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.llama_server import LlamaServer, llama_available, llama_python


@pytest.fixture(scope="session")
def llama_server() -> Iterator[LlamaServer]:
    """The server, started once; skips (loudly) only when llama-cpp-python or the GGUF is not installed."""
    reason = llama_available()
    if reason is not None:
        pytest.skip(f"e2e: llama-cpp-python server unusable from {llama_python()}: {reason}")
    # Anything else (the model will not load, the port never answers) is a failure, not a skip.
    with LlamaServer() as server:
        print(f"\nllama server {server.url} ready in {server.started_in_seconds:.1f} s, log {server.log_path}")
        yield server
