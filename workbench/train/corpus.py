"""Training corpus: the Python standard library of the running interpreter, split by file."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import ConfigError

# Generated tables and data dumps drown a small model in noise (see ECOSYSTEM-NOTES.md).
EXCLUDED_PARTS = ("test", "tests", "idle_test", "encodings", "pydoc_data", "site-packages",
                  "__pycache__", "lib2to3")
EXCLUDED_NAMES = ("unicodedata", "_pydecimal.py", "keysym", "_aix_support.py")
MAX_FILE_BYTES = 200_000


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]

    def read(self, which: str) -> list[str]:
        files = self.train if which == "train" else self.heldout
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str, heldout_every: int) -> bool:
    """Deterministic by path: same split on every machine and Python patch release."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % heldout_every == 0


def split_corpus(root: str | Path | None = None, heldout_every: int = 20) -> CorpusSplit:
    """All ``*.py`` under ``root`` (tests and data tables excluded), split by file."""
    base = Path(root) if root is not None else default_corpus_root()
    if not base.is_dir():
        raise ConfigError(f"corpus: folder {str(base)!r} does not exist")
    train: list[Path] = []
    held: list[Path] = []
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base).as_posix()
        parts = rel.split("/")
        if any(p in EXCLUDED_PARTS or p.startswith("test_") for p in parts):
            continue
        if any(n in rel for n in EXCLUDED_NAMES) or f.stat().st_size > MAX_FILE_BYTES:
            continue
        (held if is_heldout(rel, heldout_every) else train).append(f)
    if not train:
        raise ConfigError(f"corpus: no usable *.py files under {str(base)!r}")
    if not held:  # tiny corpora: hold out the last file so held-out loss always exists
        held.append(train.pop())
    return CorpusSplit(base, tuple(train), tuple(held))
