"""Loading specs: built-ins, HF directories (single and sharded), and the errors naming files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.loader import ModelLoadError, load_model, model_id, pick_device, pick_dtype
from daemon.model.parallel.group import TPGroup
from daemon.model.runner import ModelRunner, ScheduledChunk
from daemon.model.tokenizer import HFTokenizer
from tests.support.checkpoints import save_llama, write_tokenizer

Checkpoint = Callable[..., tuple[Path, torch.nn.Module]]


def copy_checkpoint(llama_checkpoint: Checkpoint, tmp_path: Path) -> Path:
    src, _ = llama_checkpoint("none", False)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_a_hugging_face_cache_snapshot_is_named_by_its_repo(
        llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    src, _ = llama_checkpoint("none", False)
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / ("ab" * 20)
    shutil.copytree(src, snapshot)
    assert load_model(str(snapshot), "cpu", "auto").name == "meta-llama/Llama-3.2-1B"
    assert model_id(snapshot / ".") == "meta-llama/Llama-3.2-1B"
    assert model_id(tmp_path / "snapshots" / "x") == "x"  # not in a cache: its own name
    assert model_id(tmp_path / "my-model") == "my-model"


def edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_hf_directory_loads_config_tokenizer_and_eos(llama_checkpoint: Checkpoint) -> None:
    path, _ = llama_checkpoint("llama3", True)
    loaded = load_model(str(path), "cpu", "auto")
    assert loaded.name == path.name and loaded.max_model_len == 512
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    assert loaded.config.tie_word_embeddings
    assert loaded.model.dtype == torch.float32
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.eos_token_ids == [1]
    assert loaded.tokenizer.encode("hello")[0] == loaded.tokenizer.bos_token_id == 0


def test_sharded_checkpoint_matches_single_file(tmp_path: Path,
                                                llama_checkpoint: Checkpoint) -> None:
    single, _ = llama_checkpoint("none", False)
    save_llama(tmp_path, "none", False, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = load_model(str(single), "cpu", torch.float32, kernels="torch").model
    b = load_model(str(tmp_path), "cpu", torch.float32, kernels="torch").model
    assert len(list(a.parameters())) == 3 + 2 * 6  # embedding, head, final norm + 6 per layer
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_missing_directory_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nowhere: not a directory"):
        load_model(str(tmp_path / "nowhere"))


def test_missing_config_names_config_json(llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        load_model(str(path))


def test_missing_weights_names_the_file(llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: missing"):
        load_model(str(path))


def test_missing_shard_names_the_shard(tmp_path: Path) -> None:
    save_llama(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"{shard}: missing"):
        load_model(str(tmp_path))


def test_missing_tokenizer_names_tokenizer_json(llama_checkpoint: Checkpoint,
                                                tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: missing"):
        load_model(str(path))


def test_unsupported_architecture_is_named(llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"config\.json: architecture 'GPT2LMHeadModel'"):
        load_model(str(path))


def test_unsupported_rope_type_is_named(llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="rope_scaling type 'dynamic'"):
        load_model(str(path))


def test_shape_mismatch_names_the_tensor(llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_checkpoint, tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight.*has shape"):
        load_model(str(path))


def test_unknown_builtin_lists_the_choices() -> None:
    with pytest.raises(ModelLoadError, match="builtin:tiny, builtin:small"):
        load_model("builtin:huge")


def test_config_from_hf_reads_legacy_rope_fields() -> None:
    raw = {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "rope_theta": 5e5, "sliding_window": 128,
           "rope_scaling": {"type": "linear", "factor": 4.0}, "eos_token_id": [3, 4]}
    config = ModelConfig.from_hf(raw)
    assert config.rope_theta == 5e5 and config.head_dim == 4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == [3, 4]
    # The window is real attention (daemon/model/attention.py), not a cap on the context.
    assert config.sliding_window == 128 and config.window(0) == 128
    assert config.max_model_len == 2048
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**raw, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match=r"rope_scaling\.low_freq_factor is missing"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_qwen2_checkpoint_with_qkv_bias_matches_transformers(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(1)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), "cpu", torch.float32)
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=4)
    ids = list(range(5, 45))
    logits = runner.run([ScheduledChunk(ids, 0, [0, 1, 2], True)])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    assert (logits[0] - expected).abs().max() <= 1e-4


def test_pick_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert pick_device("cpu") == cpu
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="--dtype"):
        pick_dtype("int8", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            pick_device("cuda")


def test_kernel_choices_are_checked(llama_checkpoint: Checkpoint) -> None:
    path, _ = llama_checkpoint("none", False)
    assert load_model(str(path), "cpu", torch.float32).kernels == "cpu"
    assert load_model(str(path), "cpu", torch.float16).kernels == "torch"  # no fp16 kernels
    with pytest.raises(ModelLoadError, match="--quantization int8 needs the CPU kernels"):
        load_model(str(path), "cpu", torch.float32, kernels="torch", quantization="int8")
    with pytest.raises(ModelLoadError, match="--kernels must be one of auto, torch"):
        load_model(str(path), "cpu", torch.float32, kernels="fast")
    # A fused CPU layer would skip a row-parallel linear's all-reduce: ranks keep torch ops.
    assert load_model(str(path), "cpu", torch.float32, group=TPGroup(0, 2)).kernels == "torch"
    with pytest.raises(ModelLoadError, match="CPU kernels run one rank, not 2"):
        load_model(str(path), "cpu", torch.float32, group=TPGroup(1, 2), quantization="int8")
