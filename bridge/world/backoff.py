"""The world link's reconnect backoff is the bridge's one backoff (`bridge.backoff`): kept importable here."""

from bridge.backoff import BASE_SECONDS, CAP_SECONDS, HEALTHY_AFTER_SECONDS, Backoff

__all__ = ["BASE_SECONDS", "CAP_SECONDS", "HEALTHY_AFTER_SECONDS", "Backoff"]
