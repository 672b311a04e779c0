"""Fixtures: a live server and solo greedy references (defined in serving.py)."""

from serve.serving import http, reference_engine, serve_head, server, solo  # noqa: F401
