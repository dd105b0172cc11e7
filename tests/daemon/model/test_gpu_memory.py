"""--gpu-memory-utilization: the arithmetic of the KV cache's share (daemon/model/gpu_memory.py) with
the device's readings given, and its refusal where there is no GPU. The readings themselves are
taken on a GPU by tests/gpu/gpu_check.py."""

from __future__ import annotations

import pytest

from daemon.model.gpu_memory import Measured, Start, plan_kv_cache, profile_chunks
from tests.support.options import model_options

GIB = 1 << 30
MIB = 1 << 20
START = Start(total=140 * GIB, free=139 * GIB, reserved=0)
# Weights 2.5 GiB; the profile's peak 4 GiB of which 512 MiB were its own KV cache; the
# process took 300 MiB outside torch's allocator (3 GiB held by it after the profile).
MEASURED = Measured(free=139 * GIB - 3 * GIB - 300 * MIB, reserved=3 * GIB,
                    peak_reserved=4 * GIB, weights=5 * GIB // 2, profile_cache=512 * MIB)


def test_the_cache_gets_what_the_fraction_leaves() -> None:
    plan = plan_kv_cache(START, MEASURED, 0.9, bytes_per_block=MIB, graphs=False)
    assert plan.allowed == int(140 * GIB * 0.9)
    assert (plan.weights, plan.activations, plan.other, plan.graphs) == (
        5 * GIB // 2, GIB, 300 * MIB, 0)
    assert plan.kv_bytes == plan.allowed - 5 * GIB // 2 - GIB - 300 * MIB
    assert plan.num_blocks == plan.kv_bytes // MIB
    assert "KV cache" in plan.describe() and f"{plan.num_blocks} blocks" in plan.describe()


def test_cuda_graphs_keep_room_for_their_pool() -> None:
    without = plan_kv_cache(START, MEASURED, 0.5, MIB, graphs=False)
    with_graphs = plan_kv_cache(START, MEASURED, 0.5, MIB, graphs=True)
    assert with_graphs.graphs == without.activations == GIB
    assert without.num_blocks - with_graphs.num_blocks == GIB // MIB


def test_other_processes_memory_does_not_count_but_must_leave_the_fraction_free() -> None:
    busy = Start(total=140 * GIB, free=60 * GIB, reserved=0)
    measured = Measured(free=60 * GIB - 3 * GIB, reserved=3 * GIB, peak_reserved=3 * GIB,
                        weights=3 * GIB, profile_cache=0)
    assert plan_kv_cache(busy, measured, 0.4, MIB, False).kv_bytes == int(140 * GIB * 0.4) - 3 * GIB
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.5 asks for 70.00 GiB .* "
                                         r"only 60.00 GiB are free"):
        plan_kv_cache(busy, measured, 0.5, MIB, False)


def test_a_fraction_below_the_weights_is_refused_with_the_figures() -> None:
    with pytest.raises(ValueError, match=r"0.02 leaves no room for the KV cache: .*weights 2.50"):
        plan_kv_cache(START, MEASURED, 0.02, MIB, False)


def test_profile_ticks_hold_the_longest_chunk_and_every_sequence() -> None:
    (prefill_tick, decodes), num_blocks = profile_chunks(8, 512, 2048, 16)
    (prefill,) = prefill_tick
    assert len(prefill.token_ids) == 512 and prefill.start_pos + 512 == 2048
    assert len(decodes) == 8 and all(c.needs_logits for c in decodes)
    blocks = {b for chunk in [prefill, *decodes] for b in chunk.block_table}
    assert blocks == set(range(num_blocks))


def test_the_setting_is_refused_without_a_gpu() -> None:
    from daemon.model.parallel.load import load_runner

    options = model_options(model="builtin:tiny", device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization .* on cpu: size it with "
                                         r"--kv-cache-blocks"):
        load_runner(options)
