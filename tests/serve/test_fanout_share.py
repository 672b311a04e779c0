"""Fairness per HTTP request: while single requests run or wait, the choices of several-choice
requests (OpenAI ``n``) hold at most one batch slot per such request, and never more than the
single requests do. Many single clients beside a few floods then share a batch near their own
size (issue 40: 40 normal clients beside 8 n=16 floods ran in batches of 64, not ~48)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve.serving import CANARY, serving, still_serves

from workbench.serve.server import ServerHandle

SINGLES, FLOODS = 5, 2


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head) as handle:
        yield handle


def test_floods_hold_one_slot_per_request_beside_many_singles(adv: ServerHandle,
                                                              canary_text: str) -> None:
    loop = adv.loop
    stop = threading.Event()
    flood: list[int] = []
    singles: list[int] = []
    seen: list[tuple[int, int]] = []  # (fan-out choices running, single requests live)

    def flooder() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                flood.append(c.post(adv.url + "/v1/completions", json={
                    "prompt": "x = [", "n": 4, "max_tokens": 8,
                    "temperature": 0.8}).status_code)

    def single() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(adv.url + "/generate", json=CANARY)
                singles.append(r.status_code)
                assert r.status_code != 200 or r.json()["text"] == canary_text

    def composition(_: object) -> tuple[int, int]:
        fan = sum(t.share == "fanout" for t in loop._live.values())
        return fan, len(loop._live) - fan

    threads = [threading.Thread(target=flooder) for _ in range(FLOODS)] + \
        [threading.Thread(target=single) for _ in range(SINGLES)]
    # no ramp while the single clients are between requests (however slow a busy machine
    # makes them): only the rule beside single requests is looked at
    loop.FANOUT_RAMP_S = 60.0  # type: ignore[misc]  # this server's loop only (restored below)
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            seen.append(adv.call(composition))
            time.sleep(0.02)
    finally:
        stop.set()
        del loop.FANOUT_RAMP_S  # back to the class's value: the floods' last requests finish
        for t in threads:
            t.join()
    assert singles and set(singles) == {200}, singles
    assert 200 in flood, flood
    with_singles = [fan for fan, single in seen if single]
    assert with_singles and max(with_singles) <= FLOODS, sorted(set(seen))
    still_serves(adv, canary_text)
