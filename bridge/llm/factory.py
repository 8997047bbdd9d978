"""Choose the LLM backend named by the settings."""

from __future__ import annotations

from bridge.llm._http import DEFAULT_RETRY, RetryPolicy
from bridge.llm.base import LLMBackend
from bridge.llm.coordinator import CoordinatorBackend
from bridge.llm.ollama import OllamaBackend
from bridge.llm.openai import OpenAIBackend
from bridge.settings import Settings

__all__ = ["RetryPolicy", "make_backend"]


def make_backend(settings: Settings, *, retry: RetryPolicy = DEFAULT_RETRY) -> LLMBackend:
    """The backend for NPC_BRIDGE_LLM_BACKEND, talking to NPC_BRIDGE_LLM_URL."""
    if settings.llm_backend == "coordinator":
        return CoordinatorBackend(settings.llm_url, settings.llm_worker, retry=retry)
    if settings.llm_backend == "openai":
        return OpenAIBackend(settings.llm_url, retry=retry)
    return OllamaBackend(settings.llm_url, retry=retry)
