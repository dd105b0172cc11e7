"""The proxy benchmark's reading of py-spy's collapsed stacks."""

from loadtest import bench_proxy

STACKS = """\
main (tether/cli.py:9);send (uvicorn/protocols/http/httptools_impl.py:5);write (libc.so.6) 6
main (tether/cli.py:9);stream (proxy/openai/completions.py:200);sse_json (proxy/http/sse.py:12) 3
main (tether/cli.py:9);stream (proxy/openai/completions.py:210) 1
not a sample line
"""


def test_shares_are_per_function_without_line_numbers() -> None:
    got = bench_proxy.summarise_stacks(STACKS)
    assert got["samples"] == 10
    assert got["self"] == [("write (libc.so.6)", 0.6), ("sse_json (proxy/http/sse.py)", 0.3),
                           ("stream (proxy/openai/completions.py)", 0.1)]
    # Inclusive shares list tether's own functions only; a function counts once per sample.
    assert got["inclusive"] == [("stream (proxy/openai/completions.py)", 0.4),
                                ("sse_json (proxy/http/sse.py)", 0.3)]


def test_no_samples_no_shares() -> None:
    assert bench_proxy.summarise_stacks("") == {"samples": 0, "inclusive": [], "self": []}
