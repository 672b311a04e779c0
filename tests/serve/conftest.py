"""Fixtures: a live server and solo greedy references (defined in serving.py)."""

from serve.serving import (  # noqa: F401
    canary_text,
    http,
    reference_engine,
    server,
    solo,
)
