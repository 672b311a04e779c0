"""Kernel tests: Triton runs under its CPU interpreter unless a CUDA GPU is present.

TRITON_INTERPRET must be set before triton is first imported (triton.language's own @jit helpers
are built at import time). Importing ``transformers``' Llama imports triton, so when another test
folder is collected first the variable may come too late: ``triton_ready`` then fails with the
fix instead of letting every kernel test die with an obscure interpreter error.
"""

from __future__ import annotations

import os
import sys

import torch

_CUDA = torch.cuda.is_available()
_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def triton_ready() -> None:
    """Skip without triton; fail loudly if triton was imported before TRITON_INTERPRET=1 on CPU."""
    pytest.importorskip("triton")
    if not _CUDA and _TRITON_PREIMPORTED:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1 "
            "(e.g. by `from transformers import LlamaForCausalLM` in an earlier test folder). "
            "Set TRITON_INTERPRET=1 in the environment or at the top of tests/conftest.py."
        )
