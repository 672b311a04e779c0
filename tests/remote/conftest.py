"""Fixtures: the live native server and solo greedy references (tests/serve/serving.py)."""

from serve.serving import http, reference_engine, server, solo  # noqa: F401
