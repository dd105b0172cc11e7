"""The speculative peers bench's reading of both servers' counters and its medians."""

import pytest

from loadtest import bench_speculative_peers as peers
from loadtest.metrics import parse_metrics

TETHER = """\
# TYPE tether_spec_decode_num_drafts counter
tether_spec_decode_num_drafts_total 36.0
# TYPE tether_spec_decode_num_draft_tokens counter
tether_spec_decode_num_draft_tokens_total 180.0
# TYPE tether_spec_decode_num_accepted_tokens counter
tether_spec_decode_num_accepted_tokens_total 150.0
"""
VLLM = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 50.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
"""


def test_both_servers_counters_are_read_and_a_server_without_them_counts_0() -> None:
    assert peers.spec_counts(parse_metrics(TETHER)) == {
        "drafts": 36, "draft_tokens": 180, "accepted_tokens": 150}
    # vLLM's per-position counter is not its accepted total.
    assert peers.spec_counts(parse_metrics(VLLM)) == {
        "drafts": 10, "draft_tokens": 50, "accepted_tokens": 30}
    assert peers.spec_counts(parse_metrics("# TYPE x counter\nx_total 1.0\n")) == {
        "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}


def run(spec: str, tok_s: float, text: str, drafts: int = 0, accepted: int = 0,
        case: str = "copy", line: str = "vllm-fp32") -> dict:
    return {"line": line, "spec": spec, "case": case, "tok_s": tok_s, "text": text,
            "drafts": drafts, "accepted_tokens": accepted}


def test_medians_ratio_acceptance_and_same_text() -> None:
    runs = [run("off", 100, "a"), run("off", 120, "a"), run("on", 300, "a", 30, 120),
            run("on", 250, "a", 10, 40), run("off", 50, "b", case="chat"),
            run("on", 40, "c", 20, 0, case="chat"), run("off", 80, "x", line="tether-q4_1")]
    got = peers.summarize(runs)
    copy = got["vllm-fp32"]["copy"]
    assert (copy["off_tok_s"], copy["on_tok_s"]) == (110, 275)
    assert copy["speedup"] == pytest.approx(2.5) and copy["same_text"]
    assert copy["acceptance_length"] == pytest.approx(5.0)  # 1 + 160 accepted / 40 drafts
    chat = got["vllm-fp32"]["chat"]
    assert chat["speedup"] == pytest.approx(0.8) and chat["same_text"] is False
    assert chat["acceptance_length"] == 1.0
    # A line whose speculating start failed: its off figure, nothing to compare.
    alone = got["tether-q4_1"]["copy"]
    assert alone["off_tok_s"] == 80 and alone["speedup"] is None
    assert alone["same_text"] is None and alone["acceptance_length"] is None
