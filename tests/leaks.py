"""Nothing leaks: no socket outlives the test run.

A pytest plugin (tests/conftest.py imports its hook and fixture; ``-p leaks`` loads it alone).
Every ``socket.socket`` made in the process is noted (an audit hook on ``socket.__new__``) with
the test that was running and where it was made. When the session's fixtures are torn down the
run's last teardown collects garbage and fails, naming each socket, if

- a socket is still open (something long-lived holds it: a library's client cache, a pool, a
  thread that was never stopped), or
- the collection itself had to close one (``ResourceWarning: unclosed <socket...>``): it was
  left to the garbage collector instead of being closed.

Either one used to surface only as a ``ResourceWarning`` printed at interpreter exit, after
the summary, naming no test."""

from __future__ import annotations

import gc
import socket
import sys
import traceback
import warnings
import weakref
from collections.abc import Iterator

import pytest

_phase = ["collection"]  # the test whose setup, call or teardown runs now
_made: weakref.WeakKeyDictionary[socket.socket, tuple[str, list[traceback.FrameSummary]]] = \
    weakref.WeakKeyDictionary()


def _audit(event: str, args: tuple) -> None:
    if event == "socket.__new__" and isinstance(args[0], socket.socket):
        _made[args[0]] = (_phase[0], traceback.extract_stack(limit=14)[:-1])


sys.addaudithook(_audit)  # an audit hook cannot be removed: added once, at import


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _phase[0] = item.nodeid


def _where(s: socket.socket) -> str:
    made = _made.get(s)
    if made is None:
        return f"{s!r}\n  made before this plugin was loaded"
    test, stack = made
    frames = "".join(traceback.format_list(stack[-8:]))
    return f"{s!r}\n  made during {test}, at\n{frames}"


def open_sockets() -> list[socket.socket]:
    """Every ``socket.socket`` in the process that is not closed."""
    return [o for o in gc.get_objects()  # type(o): no __class__ lookup on lazy objects
            if issubclass(type(o), socket.socket) and o.fileno() != -1]


def leaked_sockets() -> list[str]:
    """A description of each socket still open after a garbage collection, and of each one that
    collection had to close; [] when none."""
    before = {repr(s): _where(s) for s in open_sockets()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    out = [_where(s) for s in open_sockets()]
    for w in caught:
        text = str(w.message)
        if issubclass(w.category, ResourceWarning) and "socket" in text:
            made = next((v for k, v in before.items() if k in text), None)
            out.append(f"closed only by the garbage collector: {text}\n" +
                       (made.partition("\n")[2] if made else "  made at an unknown place"))
    return out


@pytest.fixture(scope="session", autouse=True)
def no_socket_outlives_the_run() -> Iterator[None]:
    """Set up before, so torn down after, every other session fixture (servers included)."""
    yield
    leaks = leaked_sockets()
    if leaks:
        pytest.fail(f"{len(leaks)} socket(s) outlived the test run (close each client, "
                    "response and connection a test opens; each is named by the test that "
                    "made it, not the last test, whose teardown found it):\n\n" +
                    "\n".join(leaks),
                    pytrace=False)
