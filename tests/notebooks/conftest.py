"""Browser checks of the notebooks: exported HTML (offline) and a live JupyterLab.

Skipped without Debian's chromium (``apt-get install -y chromium``); the tests themselves
``importorskip`` playwright-python and the Jupyter packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # nb_browser.py

from nb_browser import CHROMIUM  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=f"{CHROMIUM} missing (apt-get install -y chromium)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents and not CHROMIUM.exists():
            item.add_marker(skip)
