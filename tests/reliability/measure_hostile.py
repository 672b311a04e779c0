"""Measure what hostile inputs cost a running ``workbench serve`` (issue 15's figures).

    python tests/reliability/measure_hostile.py [--model data/models/wb-target]
                                                [--draft data/models/wb-eagle3] [--mb 50]

Starts ``python -m workbench serve`` on loopback, then for each hostile request (a body of
``--mb`` MB sent in full; the same announced by Content-Length only; a text prompt just under
the body limit; a 10 MB prompt within a raised body limit is not tried: the limit is the
point) prints the time to its rejection, the latencies of normal requests sent meanwhile (one
after another), and the server's RSS before and after. Not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (reliability.kit)

from reliability.kit import serve_subprocess  # noqa: E402

NORMAL = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 16,
                                                          "temperature": 0}}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def normal_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.post("/generate", json=NORMAL)
            r.raise_for_status()
            out.append(time.perf_counter() - t0)


def hostile(url: str, name: str, send: object) -> dict[str, object]:
    stop = threading.Event()
    lat: list[float] = []
    th = threading.Thread(target=normal_latencies, args=(url, stop, lat))
    th.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    status = send()  # type: ignore[operator]
    reject_s = time.perf_counter() - t0
    time.sleep(0.5)
    stop.set()
    th.join()
    return {"case": name, "status": status, "reject_s": round(reject_s, 3),
            "normal_n": len(lat), "normal_median_s": round(statistics.median(lat), 3),
            "normal_max_s": round(max(lat), 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="data/models/wb-target")
    ap.add_argument("--draft", default="data/models/wb-eagle3")
    ap.add_argument("--mb", type=int, default=50)
    ns = ap.parse_args()
    proc, url = serve_subprocess(ns.model, ns.draft)
    host, port = url[7:].rsplit(":", 1)
    try:
        httpx.post(url + "/generate", json=NORMAL, timeout=300).raise_for_status()
        before = rss_mb(proc.pid)
        big = b'{"text": "' + b"a" * (ns.mb << 20) + b'"}'
        under = json.dumps({"text": "def f(x): return x\n" * ((7 << 20) // 20)}).encode()

        def sent() -> object:
            try:
                return httpx.post(url + "/generate", content=big, timeout=300,
                                  headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError as e:  # closed while still sending, after the 413
                return f"{type(e).__name__} (connection closed by the server)"

        def announced() -> object:
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                          % len(big))
                return s.recv(200).split(b"\r\n")[0].decode()

        def under_limit() -> object:
            r = httpx.post(url + "/generate", content=under, timeout=300,
                           headers={"content-type": "application/json"})
            return f"{r.status_code} {r.json()['error']['message'][:60]}"

        rows = [hostile(url, "none (normal requests alone)", lambda: "-"),
                hostile(url, f"{ns.mb} MB body sent", sent),
                hostile(url, f"{ns.mb} MB announced (Content-Length only)", announced),
                hostile(url, "7 MB text prompt (under the 8 MB body limit)", under_limit)]
        after = rss_mb(proc.pid)
        print(json.dumps({"rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
                          "cases": rows}, indent=2))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
