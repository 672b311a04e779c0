"""The API key, read as operators write it: ``--api-key-file`` (its first line), ``--api-key``
(visible in the process list, so a warning) or the ``WORKBENCH_API_KEY`` environment variable,
each validated alike (:func:`clean_key`):

- a leading UTF-8 byte-order mark (Notepad, PowerShell 5's ``Out-File -Encoding utf8``) and
  surrounding whitespace, CR and LF included, are not part of the key;
- a blank key is refused, never read as "no key": a secret that failed to render must not start
  an open server (``WORKBENCH_API_KEY`` unset is no key; set and blank is an error);
- a key must be printable ASCII without spaces (RFC 6750's ``b64token`` is narrower still):
  anything else no client can send in an ``Authorization`` header, so every request would be
  401 with the right key;
- a key file its group or others may read or write is refused, as ssh refuses such a private
  key and PostgreSQL such a key file (``chmod 600``; a Kubernetes secret volume needs
  ``defaultMode: 0400`` or ``0600``).
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

from workbench.errors import ConfigError

log = logging.getLogger(__name__)

API_KEY_ENV = "WORKBENCH_API_KEY"
BOM = "\ufeff"


def clean_key(raw: str, source: str) -> str:
    """``raw`` without a leading BOM and surrounding whitespace; ConfigError naming ``source``
    when that leaves nothing, or characters a client cannot send."""
    key = raw.removeprefix(BOM).strip()
    if not key:
        raise ConfigError(f"{source}: the API key is blank; give a key, or leave {source} "
                          "unset to serve without one")
    bad = sorted({c for c in key if not "!" <= c <= "~"})
    if bad:
        raise ConfigError(f"{source}: the API key must be printable ASCII without spaces "
                          f"(no client can send {''.join(bad)!r} in an Authorization header)")
    return key


def read_key_file(path: str) -> str:
    """The first line of the key file ``path``, refused if its group or others have access."""
    source = "--api-key-file"
    try:
        mode = Path(path).stat().st_mode
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read {path}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{source}: {path} has permissions {oct(stat.S_IMODE(mode))}: its "
                          "group or others may read the key; run chmod 600 on it (ssh and "
                          "PostgreSQL refuse such key files too)")
    lines = text.removeprefix(BOM).splitlines()
    return clean_key(lines[0] if lines else "", source)


def api_key_from_args(ns: argparse.Namespace) -> str | None:
    """The API key (module doc): ``--api-key-file``, ``--api-key``, ``WORKBENCH_API_KEY``, else
    None."""
    if ns.api_key is not None and ns.api_key_file:
        raise ConfigError("--api-key/--api-key-file: give one of them")
    if ns.api_key_file:
        return read_key_file(ns.api_key_file)
    if ns.api_key is not None:
        log.warning("--api-key is visible to every local user (/proc/*/cmdline); prefer "
                    "--api-key-file or %s", API_KEY_ENV)
        return clean_key(str(ns.api_key), "--api-key")
    env = os.environ.get(API_KEY_ENV)
    return None if env is None else clean_key(env, API_KEY_ENV)
