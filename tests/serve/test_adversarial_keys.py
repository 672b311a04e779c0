"""Adversarial catalogue, API keys as operators write them (issue 53): the environment, the
file and the flag are validated alike — a blank key is refused, never an open server; a UTF-8
BOM (Notepad, PowerShell 5's ``Out-File -Encoding utf8``) and CRLF line ends are stripped; a
key with whitespace inside, control or non-ASCII characters (no client can send it in a
header) is refused; a key file that its group or others may read or write is refused, as ssh
refuses such a private key and PostgreSQL such a key file."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from workbench.errors import ConfigError
from workbench.serve.server import API_KEY_ENV, api_key_from_args


def ns(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def key_file(tmp_path: Path, raw: bytes, mode: int = 0o600) -> str:
    f = tmp_path / "key"
    f.write_bytes(raw)
    os.chmod(f, mode)
    return str(f)


@pytest.mark.parametrize("raw", ["", "   ", "\t\r\n", "\ufeff", "\ufeff \r\n"])
def test_a_blank_key_in_the_environment_is_refused(raw: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, raw)
    with pytest.raises(ConfigError, match=f"^{API_KEY_ENV}: .*blank"):
        api_key_from_args(ns())


def test_no_key_anywhere_is_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from_args(ns()) is None


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbfs3cret\r\n", b"s3cret\r\n", b"  s3cret  \n",
                                 b"\xef\xbb\xbfs3cret", b"s3cret\r\nsecond line\r\n"])
def test_a_key_file_with_a_bom_or_crlf_reads_as_written(tmp_path: Path, raw: bytes,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from_args(ns(api_key_file=key_file(tmp_path, raw))) == "s3cret"


@pytest.mark.parametrize("raw", ["\ufeffs3cret", "s3cret\r\n", " s3cret\n"])
def test_the_environment_reads_as_the_file(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, raw)
    assert api_key_from_args(ns()) == "s3cret"


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbf\r\n", b"   \r\nkey-on-line-2\n"])
def test_a_blank_key_file_is_refused(tmp_path: Path, raw: bytes) -> None:
    with pytest.raises(ConfigError, match="^--api-key-file: .*blank"):
        api_key_from_args(ns(api_key_file=key_file(tmp_path, raw)))


@pytest.mark.parametrize("key", ["two words", "tab\there", "bell\x07", "clé", "zero\u200bwidth"])
def test_a_key_no_client_can_send_is_refused(key: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(ConfigError, match=f"^{API_KEY_ENV}: .*printable ASCII"):
        api_key_from_args(ns())
    with pytest.raises(ConfigError, match="^--api-key-file: .*printable ASCII"):
        api_key_from_args(ns(api_key_file=key_file(tmp_path, key.encode())))
    with pytest.raises(ConfigError, match="^--api-key: .*printable ASCII"):
        api_key_from_args(ns(api_key=key))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o666])
def test_a_key_file_others_may_read_is_refused(mode: int, tmp_path: Path) -> None:
    path = key_file(tmp_path, b"s3cret\n", mode)
    with pytest.raises(ConfigError, match=r"^--api-key-file: .*permissions 0o6\d\d: .*chmod 600"):
        api_key_from_args(ns(api_key_file=path))


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_key_file_is_read(mode: int, tmp_path: Path) -> None:
    assert api_key_from_args(ns(api_key_file=key_file(tmp_path, b"s3cret\n", mode))) == "s3cret"
