"""Tests of bridge.memory."""
