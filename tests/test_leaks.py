"""The no-leak guard (tests/leaks.py) on small suites of its own, each run in a fresh pytest
process with only the guard loaded: a run that leaves a socket open, or leaves one for the
garbage collector to close, fails and names the test that made it and where; a tidy run passes;
with the project's pytest settings a socket dropped unclosed fails the test that dropped it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

LEAKY = '''
import gc
import socket

KEPT = []


def connected_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())  # the line named below
    server_side, _ = listener.accept()
    listener.close()
    return client, server_side


def test_tidy():
    client, server_side = connected_pair()
    client.close()
    server_side.close()


def test_keeps_a_connection():
    client, server_side = connected_pair()
    server_side.close()
    KEPT.append(client)  # a process-wide cache holding a client's keep-alive socket


class Holder:
    pass


def test_leaves_one_to_the_collector():
    gc.disable()  # the cycle below stays uncollected until the guard collects it
    client, server_side = connected_pair()
    server_side.close()
    h = Holder()
    h.me, h.sock = h, client
'''

TIDY = '''
import asyncio
import socket


def test_connections_closed():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()):
            conn, _ = listener.accept()
            conn.close()


def test_an_event_loop_closed():
    async def serve_once():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()

    asyncio.run(serve_once())
'''


DROPS_ONE = '''
import socket


def test_drops_one():
    s = socket.socket()
    del s  # unclosed: its finalizer warns


def test_a_file_is_not_a_socket():
    f = open(__file__)
    del f  # a ResourceWarning too, left to Python's default


def test_after():
    pass
'''


def run_suite(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(source)
    # pytest prints the short summary's messages whole when it sees a CI (CI or BUILD_NUMBER set)
    # and cut to the terminal's width otherwise: the inner run gets neither, so its report reads
    # the same under CI as here.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    env |= {"PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "leaks", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), *args, "test_suite.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_socket_left_open_or_to_the_collector_fails_the_run(tmp_path: Path) -> None:
    r = run_suite(tmp_path, LEAKY)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the error: the last teardown, where the guard runs
    assert "2 socket(s) outlived the test run" in out, out
    still_open, _, collected = out.partition("closed only by the garbage collector: unclosed "
                                             "<socket.socket")
    assert "made during test_suite.py::test_keeps_a_connection" in still_open, out
    assert "made during test_suite.py::test_leaves_one_to_the_collector" in collected, out
    assert "test_tidy" not in out, out
    report, _, _ = out.partition("short test summary info")
    assert report.count("in connected_pair\n    client = socket.create_connection(") == 2, out


def test_a_tidy_run_passes(tmp_path: Path) -> None:
    r = run_suite(tmp_path, TIDY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout, r.stdout


def test_the_project_settings_fail_the_test_that_drops_a_socket_unclosed(tmp_path: Path) -> None:
    """pyproject's filterwarnings: the socket's ResourceWarning, raised in its finalizer, fails
    the test during which it was dropped; the run goes on."""
    r = run_suite(tmp_path, DROPS_ONE, "-c", str(TESTS.parent / "pyproject.toml"))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "FAILED test_suite.py::test_drops_one" in out, out
    assert "2 passed" in out and "1 failed" in out, out
