"""The engine benchmark's in-process figures on builtin:tiny: the ticker loads the model the way
the daemon does, times real forward passes, and the KL of a model against itself is zero."""

from loadtest import decode_figures


def test_tick_scaling_times_real_forward_passes() -> None:
    tickers = {k: decode_figures.Ticker("builtin:tiny", k, max_tokens=512)
               for k in ("auto", "torch")}
    rows = decode_figures.tick_scaling(tickers, streams=[1, 4], contexts=[32], rounds=1)
    assert [(r["streams"], r["context"]) for r in rows] == [(1, 32), (4, 32)]
    assert all(r[k] > 0 for r in rows for k in tickers)


def test_kl_of_a_model_against_itself_is_zero() -> None:
    ref = decode_figures.Ticker("builtin:tiny", "torch", max_tokens=256)
    same = decode_figures.Ticker("builtin:tiny", "torch", max_tokens=256)
    got = decode_figures.logit_kl(ref, {"same": same}, [[1, 2, 3]], steps=3)["same"]
    assert got["kl_max"] < 1e-9 and got["top1_agree"] == 1.0


def test_the_roofline_counts_only_the_head_rows_a_token_needs() -> None:
    """builtin:small's head has 49,152 rows, its byte tokenizer names 260 of them."""
    loaded = decode_figures.Ticker("builtin:small", "auto", max_tokens=64).loaded
    config = loaded.config
    assert loaded.model.vocab_limit == 260 < config.vocab_size
    got = decode_figures.model_weight_bytes(loaded, None)
    assert got == decode_figures.weight_bytes(config, 260, 4)
    assert decode_figures.weight_bytes(config, config.vocab_size, 4) - got == (
        (config.vocab_size - 260) * config.hidden_size * 4)
