"""Sections a (correctness) and b (decode speed) of gpu_check.py: our engine in this process,
built by the daemon's own `make_runner` (CUDA graphs captured as `tether daemon` captures
them), against transformers on the same device."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_case import Case

from daemon.engine.core import Engine
from daemon.model.chat_template import BYTE_CHAT_TEMPLATE
from daemon.model.loader import LoadedModel, load_model
from daemon.model.parallel.load import make_runner
from daemon.model.runner import ModelRunner
from ipc.records import Admitted, Delta, RequestKind, SamplingParams, Submit
from tether.options import daemon_options
from tether.settings import Settings

Left = Callable[[], float]  # seconds left of the run's budget


class Said(logging.Handler):
    """The daemon's log lines while a runner is made (graph capture, memory plan)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


KEPT: dict[str, Any] = {}  # models one section leaves to the next

SAID = Said()
logging.getLogger("tether.daemon").addHandler(SAID)

# --- models ------------------------------------------------------------------------------------


def make_llama(case: Case) -> Any:
    """The random Llama, built on the device in the run's dtype and saved (with a byte-level
    tokenizer and the byte tokenizer's chat template, which teaches a tool-call format) to
    case.llama_dir; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loadtest.checkpoint import write_byte_tokenizer

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(case.dtype)
    try:
        with torch.device(case.device):
            model = LlamaForCausalLM(LlamaConfig(**case.llama)).eval()
    finally:
        torch.set_default_dtype(previous)
    case.llama_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(case.llama_dir)
    write_byte_tokenizer(case.llama_dir)
    (case.llama_dir / "chat_template.jinja").write_text(BYTE_CHAT_TEMPLATE)  # written last
    return model


def checkpoint(case: Case) -> str:
    """case.llama_dir, made unless a run has left it whole."""
    if not (case.llama_dir / "chat_template.jinja").is_file():
        make_llama(case)
    return str(case.llama_dir)


def export_builtin(case: Case) -> Any:
    """transformers' Llama holding the built-in model's weights (cut from the same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from daemon.model.loaded import hf_sources

    ours = load_model(case.builtin, case.device, case.dtype, kernels="torch")
    cfg = ours.config
    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(case.dtype)
    try:
        with torch.device(case.device):
            hf = LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(previous)
    params, theirs = dict(ours.model.named_parameters()), hf.state_dict()
    with torch.no_grad():
        for name, sources in hf_sources(cfg).items():
            parts = params[name].split([theirs[s].shape[0] for s in sources])
            for source, part in zip(sources, parts, strict=True):
                theirs[source].copy_(part)
    return hf


def build_runner(case: Case, loaded: LoadedModel, num_blocks: int, max_num_seqs: int,
                 tick_tokens: int, graphs: bool) -> ModelRunner:
    """On CUDA the daemon's own runner (graphs captured); on the CPU the padded decode buckets
    run eagerly, which is what the graphs replay."""
    if case.device == "cpu":
        return ModelRunner(loaded.model, loaded.config, num_blocks,
                           graph_max_batch=max_num_seqs if graphs else 0)
    settings = Settings(model=str(case.llama_dir), device=case.device, max_num_seqs=max_num_seqs,
                        max_tokens_per_tick=tick_tokens, kv_cache_blocks=num_blocks,
                        cuda_graphs=graphs)
    return make_runner(daemon_options(settings).model, loaded)


def graph_figures(runner: ModelRunner) -> dict[str, Any]:
    graphs = runner.graphs
    return {"buckets": graphs.buckets if graphs else [], "daemon_said": SAID.lines[-4:],
            "graphs_captured": len(graphs.graphs) if graphs else 0,
            "static_ticks": runner.num_static_ticks, "eager_ticks": runner.num_eager_ticks}


# --- driving the engine ------------------------------------------------------------------------


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def submit(rid: str, prompt: str, new_tokens: int, n: int = 1,
           logprobs: int | None = None) -> Submit:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs)
    return Submit(rid, RequestKind.COMPLETION, params, n=n, prompts=[prompt], epoch=1)


def drive(engine: Engine, submits: list[Submit]) -> tuple[dict[str, list[int]],
                                                          dict[tuple[str, int], Any]]:
    """Runs the submits to the end: (prompt ids per rid, (tokens, logprobs) per sequence)."""
    prompts: dict[str, list[int]] = {}
    for sub in submits:
        answer = engine.submit(sub)
        if not isinstance(answer[0], Admitted):
            raise RuntimeError(f"{sub.rid} refused: {answer}")
        prompts[sub.rid] = list(engine.sessions[sub.rid].sequences[0].token_ids)
    outputs: dict[tuple[str, int], Any] = {}
    while engine.has_work:
        for record in engine.step():
            if isinstance(record, Delta):
                tokens, lps = outputs.setdefault((record.rid, record.index), ([], []))
                tokens += record.token_ids
                lps += [lp.logprob for lp in record.logprobs or []]
    return prompts, outputs


def make_engine(runner: ModelRunner, loaded: LoadedModel, max_num_seqs: int,
                tick_tokens: int) -> Engine:
    return Engine(runner, loaded.tokenizer, None, max_num_seqs, tick_tokens,
                  loaded.max_model_len, loaded.name)


# --- a: correctness ----------------------------------------------------------------------------


def correctness(case: Case, left: Left) -> dict[str, Any]:
    out: dict[str, Any] = {"gap_tol": case.gap_tol, "logprob_tol": case.logprob_tol}
    hf = make_llama(case)
    out["llama"] = check_model(case, str(case.llama_dir), hf)
    KEPT["llama"] = hf  # for section b; section c lets go of it
    out["builtin"] = check_model(case, case.builtin, export_builtin(case))
    out["passed"] = out["llama"]["passed"] and out["builtin"]["passed"]
    out["headline"] = "; ".join(
        f"{name}: {r['sequences_ok']}/{r['sequences']} ok, {r['tie_flips']} tie flips, "
        f"max |dlogprob| {r['max_logprob_diff']:.3g}, graphs {r['graphs']['graphs_captured']}"
        for name, r in (("llama", out["llama"]), ("builtin", out["builtin"])))
    return out


def check_model(case: Case, spec: str, hf: Any) -> dict[str, Any]:
    loaded = load_model(spec, case.device, case.dtype)
    rng = random.Random(0)
    submits = [submit(f"p{i}", text(rng, n), case.new_tokens, n=2 if i == 1 else 1, logprobs=1)
               for i, n in enumerate(case.prompt_chars)]
    runs = {}
    for graphs in (True, False):  # graphs on is the run checked; off, for comparison
        runner = build_runner(case, loaded, case.correctness_blocks, 8, 64, graphs)
        engine = make_engine(runner, loaded, 8, 64)
        prompts, outputs = drive(engine, submits)
        runs[graphs] = (prompts, outputs, engine.scheduler.num_preemptions, graph_figures(runner))
        del runner, engine
    prompts, outputs, preemptions, graphs_used = runs[True]
    limit = loaded.model.vocab_limit
    seqs = {f"{rid}.{index}": compare(hf, prompts[rid], tokens, lps, limit, case)
            for (rid, index), (tokens, lps) in sorted(outputs.items())}
    eager = runs[False][1]
    same = sum(outputs[k][0] == eager[k][0] for k in outputs)
    result = {
        "model": spec, "kernels": loaded.kernels, "sequences": len(seqs),
        "sequences_ok": sum(s["ok"] for s in seqs.values()),
        "tie_flips": sum(s["tie_flips"] for s in seqs.values()),
        "max_logprob_diff": max(s["max_logprob_diff"] for s in seqs.values()),
        "preemptions": preemptions, "graphs": graphs_used,
        "graphs_vs_eager_same_tokens": f"{same}/{len(outputs)}",
        "n2_choices_equal": outputs["p1", 0][0] == outputs["p1", 1][0],
        "hf_free_run": free_run(hf, prompts, outputs, limit, case), "per_sequence": seqs}
    captured = graphs_used["graphs_captured"] > 0 or case.device == "cpu"
    result["passed"] = (result["sequences_ok"] == len(seqs) == len(case.prompt_chars) + 1
                        and preemptions > 0 and graphs_used["static_ticks"] > 0 and captured)
    return result


@torch.inference_mode()
def compare(hf: Any, prompt: list[int], tokens: list[int], logprobs: list[float],
            vocab_limit: int | None, case: Case) -> dict[str, Any]:
    """Teacher-forced: HF's logits along our tokens. A token of ours that is not HF's argmax
    must be within gap_tol of it (a near-tie that bf16 rounding flips)."""
    ids = torch.tensor([prompt + tokens[:-1]], device=case.device)
    logits = hf(ids).logits[0, len(prompt) - 1 :].float()
    if vocab_limit is not None:
        logits[:, vocab_limit:] = float("-inf")
    ours = torch.tensor(tokens, device=case.device)[:, None]
    gaps = (logits.max(dim=-1).values - logits.gather(1, ours)[:, 0]).tolist()
    ref_lp = torch.log_softmax(logits, dim=-1).gather(1, ours)[:, 0]
    lp_diff = (ref_lp - torch.tensor(logprobs, device=case.device)).abs().tolist()
    flips = [i for i, g in enumerate(gaps) if g > 0]
    return {"tokens": len(tokens), "tie_flips": len(flips),
            "first_divergence": flips[0] if flips else None,
            "gap_there": gaps[flips[0]] if flips else None, "max_gap": max(gaps),
            "max_logprob_diff": max(lp_diff),
            "ok": max(gaps) <= case.gap_tol and max(lp_diff) <= case.logprob_tol}


@torch.inference_mode()
def free_run(hf: Any, prompts: dict[str, list[int]], outputs: dict[tuple[str, int], Any],
             vocab_limit: int | None, case: Case) -> dict[str, int | None]:
    """HF's own greedy continuation: the first step where it leaves ours (None: never)."""
    out: dict[str, int | None] = {}
    masked = {} if vocab_limit is None else {
        "suppress_tokens": list(range(vocab_limit, hf.config.vocab_size))}
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt], device=case.device)
        theirs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens,
                             do_sample=False, pad_token_id=0, **masked)[0, len(prompt) :].tolist()
        ours = outputs[rid, 0][0]
        out[rid] = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                         if a != b), None)
    return out


# --- b: speed ----------------------------------------------------------------------------------


def speed(case: Case, left: Left) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from loadtest.bench_engine import workload

    loaded = load_model(checkpoint(case), case.device, case.dtype)
    mix = workload(case.speed_mix, 0)
    out: dict[str, Any] = {"model": str(case.llama_dir), "prompt_chars": case.speed_len[0],
                           "new_tokens": case.speed_len[1], "mix": mix,
                           "max_tokens_per_tick": case.tick_tokens}
    out["ours_graphs"] = ours_speed(case, loaded, mix, graphs=True)
    hf = KEPT.pop("llama", None) or LlamaForCausalLM.from_pretrained(
        case.llama_dir, dtype=case.dtype).to(case.device).eval()
    out["transformers"] = hf_speed(case, hf, mix)
    del hf
    if left() > 60 * case.estimate_scale:
        out["ours_eager"] = ours_speed(case, loaded, mix, graphs=False)
    else:
        out["ours_eager"] = f"skipped: {left():.0f} s left"
    theirs, ours = out["transformers"], out["ours_graphs"]
    out["ratios"] = {k: ours[k] / theirs[k] for k in theirs if k in ours and theirs[k]}
    out["goals"] = {"batch1 >= 3x": out["ratios"].get("tok_s_1", 0) >= 3,
                    "mix >= 5x": out["ratios"].get("mix_tok_s", 0) >= 5}
    out["headline"] = ", ".join(f"{k} {ours[k]:.0f} vs {theirs[k]:.0f} ({out['ratios'][k]:.1f}x)"
                                for k in out["ratios"]) + (
        f"; the mix's untimed first pass {ours['mix_cold_tok_s']:.0f}")
    return out


def ours_speed(case: Case, loaded: LoadedModel, mix: list[tuple[int, int]],
               graphs: bool) -> dict[str, Any]:
    streams = max(case.speed_streams)
    runner = build_runner(case, loaded, case.speed_blocks, streams, case.tick_tokens, graphs)
    engine = make_engine(runner, loaded, streams, case.tick_tokens)
    rng = random.Random(1)

    def timed(jobs: list[tuple[int, int]]) -> float:
        subs = [submit(f"s{rng.random()}", text(rng, p), g) for p, g in jobs]
        t0 = time.perf_counter()
        drive(engine, subs)  # every tick ends reading the sampled ids: the device is done
        return time.perf_counter() - t0

    prompt, new = case.speed_len
    timed([(8, 4)])  # warm-up
    out: dict[str, Any] = {}
    # The mix once untimed (new prompts each pass: no prefix-cache hits): the first use of its
    # shapes (Triton compiling, each bucket's first replay) stays out of the timed pass.
    out["mix_cold_tok_s"] = sum(g for _, g in mix) / timed(mix)
    itl = min((timed([(prompt, new + 1)]) - timed([(prompt, 1)])) / new for _ in range(2))
    out["tok_s_1"] = 1 / itl
    for n in case.speed_streams[1:]:
        out[f"tok_s_{n}"] = n * new / timed([(prompt, new)] * n)
    out["mix_tok_s"] = sum(g for _, g in mix) / timed(mix)
    out["runner"] = graph_figures(runner)
    return out


def hf_speed(case: Case, hf: Any, mix: list[tuple[int, int]]) -> dict[str, Any]:
    from loadtest.bench_engine import left_padded

    gen = torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def timed(lens: list[int], new: int) -> float:
        ids, mask = (t.to(case.device) for t in left_padded(lens, gen))
        _sync(case)
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync(case)
        return time.perf_counter() - t0

    prompt, new = case.speed_len
    timed([8], 4)  # warm-up
    out: dict[str, Any] = {}
    itl = min((timed([prompt], new + 1) - timed([prompt], 1)) / new for _ in range(2))
    out["tok_s_1"] = 1 / itl
    for n in case.speed_streams[1:]:
        out[f"tok_s_{n}"] = n * new / timed([prompt] * n, new)
    wall = 0.0
    for i in range(0, len(mix), case.hf_batch):  # static batches, as bench_engine.py
        batch = mix[i : i + case.hf_batch]
        wall += timed([p for p, _ in batch], max(g for _, g in batch))
    out["mix_tok_s"] = sum(g for _, g in mix) / wall
    out["mix_batch"] = case.hf_batch
    return out


def _sync(case: Case) -> None:
    if case.device == "cuda":
        torch.cuda.synchronize()
