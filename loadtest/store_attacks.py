"""What the Responses store's attacks of issue 34 (items 13, 14, 18) cost a bystander: the
longest wait of a streaming chat client beside each, on a `tether serve` pair of its own.

    python -m loadtest.store_attacks [--model sim:20] [--repeat 3] [--out DIR] [--repo PATH]

Attacks (3.9 MB is what a 4 MiB body holds):
  conversation  a turn on a conversation of 8 items of 3.9 MB (appended before the window)
  pages         8 clients reading 3 pages each of a conversation's 3.9 MB items
  appends       8 clients appending 3 items of 3.9 MB each to one conversation
  references    4 clients looping requests of 100 item_references for 5 s, beside a GET loop
  items         4 bodies of 138,000 input items at once
Prints each attack's longest bystander gap (and what its requests were answered) and writes
store_attacks.json under results/store-attacks-<timestamp>/ (or --out). The e2e tests
(tests/e2e/test_store_bounds.py) assert the bound, 1 s; this measures it. The bystander and the
concurrency helpers are the tests' own (tests/support).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.pair import REPO, ServerPair
from loadtest.report import results_dir, summary, write_json
from tests.support.streams import Paced
from tests.support.wait import at_once

BIG = 3_900_000
Attack = Callable[[str], Counter[int]]


def _post(url: str, path: str, **kw: Any) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=300.0) as c:
        return c.post(path, **kw)


def _conversation(url: str, items: int) -> str:
    cid = str(_post(url, "/v1/conversations", json={}).json()["id"])
    for i in range(items):
        _post(url, f"/v1/conversations/{cid}/items",
              json={"items": [{"role": "user", "content": chr(97 + i) * BIG}]})
    return cid


def conversation(url: str) -> Callable[[], Counter[int]]:
    cid = _conversation(url, 8)
    return lambda: Counter([_post(url, "/v1/responses", json={
        "conversation": cid, "input": "hi", "max_output_tokens": 4}).status_code])


def pages(url: str) -> Callable[[], Counter[int]]:
    cid = _conversation(url, 3)

    def read(_: int) -> list[int]:
        with httpx.Client(base_url=url, timeout=300.0) as c:
            return [c.get(f"/v1/conversations/{cid}/items", params={"limit": 1}).status_code
                    for _ in range(3)]
    return lambda: Counter(s for got in at_once(8, read) for s in got)


def appends(url: str) -> Callable[[], Counter[int]]:
    cid = _conversation(url, 0)

    def append(i: int) -> list[int]:
        return [_post(url, f"/v1/conversations/{cid}/items", json={
            "items": [{"role": "user", "content": str(i) * BIG}]}).status_code
            for _ in range(3)]
    return lambda: Counter(s for got in at_once(8, append) for s in got)


def references(url: str) -> Callable[[], Counter[int]]:
    rid = _post(url, "/v1/responses", json={"max_output_tokens": 1, "input": [
        {"role": "user", "content": "x" * 4_000, "id": "words"}]}).json()["id"]
    refs = [{"type": "item_reference", "id": "words"}] * 100

    def run() -> Counter[int]:
        stop, got = threading.Event(), Counter[int]()

        def flood(_: int) -> None:
            while not stop.is_set():
                got[_post(url, "/v1/responses", json={"input": refs}).status_code] += 1

        flooders = threading.Thread(target=lambda: at_once(4, flood))
        flooders.start()
        with httpx.Client(base_url=url, timeout=300.0) as c:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                got[-c.get(f"/v1/responses/{rid}").status_code] += 1  # the GETs, negative
        stop.set()
        flooders.join()
        return got
    return run


def items(url: str) -> Callable[[], Counter[int]]:
    body = b'{"input":[' + b",".join([b'{"role":"user","content":""}'] * 138_000) + b"]}"
    return lambda: Counter(r.status_code for r in at_once(4, lambda _: _post(
        url, "/v1/responses", content=body, headers={"content-type": "application/json"})))


ATTACKS: dict[str, Callable[[str], Callable[[], Counter[int]]]] = {
    "conversation": conversation, "pages": pages, "appends": appends,
    "references": references, "items": items}


def measure(url: str, name: str, repeat: int) -> dict[str, Any]:
    gaps, answers = [], Counter[int]()
    for _ in range(repeat):
        attack = ATTACKS[name](url)
        stream = Paced(url).start()
        started = time.monotonic()
        answers += attack()
        gaps.append(stream.longest_gap(started))
        stream.stop()
    return {"gap_s": summary(gaps), "gaps_s": gaps, "answers": dict(answers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sim:20")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--only", choices=list(ATTACKS), action="append")
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout to serve (another tree, to compare)")
    args = parser.parse_args(argv)
    out = results_dir(args.out, "store-attacks")
    pair = ServerPair(args.model, max_num_seqs=8, repo=args.repo).start()
    results: dict[str, Any] = {"model": args.model}
    try:
        for name in args.only or ATTACKS:
            results[name] = measure(pair.base_url, name, args.repeat)
            gap = results[name]["gap_s"]
            print(f"{name:13s} longest gap {gap['max']:.3f} s (median of the runs "
                  f"{gap['p50']:.3f} s); answers {results[name]['answers']}", flush=True)
        results["processes"] = {k: p.pid for k, p in pair.processes().items()}
    finally:
        pair.stop()
    print(write_json(out / "store_attacks.json", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
