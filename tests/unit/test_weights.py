"""weights.checkpoint: reading checkpoints that transformers' save_pretrained wrote."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

import weights.checkpoint as checkpoint_module
from weights.checkpoint import CheckpointError, open_checkpoint, read_config


def _tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1)  # fresh values everywhere: norms are not ones, nothing is zero
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(state_dict, single-file dir, sharded dir) of one random tiny Llama."""
    model = _tiny_llama(seed=1234)
    single = tmp_path_factory.mktemp("single")
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, single, sharded


def test_layouts_are_what_the_tests_mean(saved):
    _, single, sharded = saved
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_read_equals_state_dict(saved, layout):
    state, single, sharded = saved
    with open_checkpoint(single if layout == "single" else sharded) as checkpoint:
        assert checkpoint.names() == sorted(state)
        for name, expected in state.items():
            assert checkpoint.shape(name) == tuple(expected.shape)
            assert checkpoint.dtype(name) == expected.dtype
            assert name in checkpoint
            torch.testing.assert_close(checkpoint.read(name), expected, rtol=0, atol=0)


def test_sharded_index_decides_the_file(saved):
    state, _, sharded = saved
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    checkpoint = open_checkpoint(sharded)
    assert len(set(weight_map.values())) > 1
    for name, file in weight_map.items():
        assert checkpoint._file_of(name) == file
    checkpoint.close()


def test_read_casts_and_moves(saved):
    state, single, _ = saved
    with open_checkpoint(single) as checkpoint:
        tensor = checkpoint.read("model.embed_tokens.weight", dtype=torch.bfloat16, device="cpu")
    assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
    torch.testing.assert_close(tensor, state["model.embed_tokens.weight"].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("num_parts", [1, 2, 4])
def test_read_slice_concatenates_to_the_full_tensor(saved, layout, dim, num_parts):
    state, single, sharded = saved
    with open_checkpoint(single if layout == "single" else sharded) as checkpoint:
        for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                     "lm_head.weight"):
            parts = [checkpoint.read_slice(name, dim, part, num_parts) for part in range(num_parts)]
            assert all(p.shape[dim] == state[name].shape[dim] // num_parts for p in parts)
            torch.testing.assert_close(torch.cat(parts, dim=dim), state[name], rtol=0, atol=0)


def test_read_slice_of_a_vector_and_with_dtype(saved):
    state, single, _ = saved
    name = "model.layers.0.input_layernorm.weight"
    with open_checkpoint(single) as checkpoint:
        half = checkpoint.read_slice(name, 0, 1, 2, dtype=torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, state[name][16:].half(), rtol=0, atol=0)


class _RecordingHandle:
    """Wraps a safe_open handle: forbids get_tensor, records what each slice returns."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name):
        raise AssertionError(f"read_slice read all of {name} with get_tensor")

    def get_slice(self, name):
        return _RecordingSlice(self.inner.get_slice(name), name, self.log)


class _RecordingSlice:
    def __init__(self, inner, name, log):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, key):
        tensor = self.inner[key]
        self.log.append((self.name, tensor.numel()))
        return tensor


@pytest.mark.parametrize("dim", [0, 1])
def test_read_slice_reads_only_its_part(saved, monkeypatch, dim):
    state, _, sharded = saved
    log = []
    real_safe_open = checkpoint_module.safe_open
    monkeypatch.setattr(checkpoint_module, "safe_open",
                        lambda path, framework: _RecordingHandle(real_safe_open(path, framework=framework), log))
    name = "model.layers.0.mlp.gate_proj.weight"  # [64, 32]
    with open_checkpoint(sharded) as checkpoint:
        part = checkpoint.read_slice(name, dim, 3, 4)
    full = state[name]
    torch.testing.assert_close(part, full.chunk(4, dim=dim)[3], rtol=0, atol=0)
    assert log == [(name, full.numel() // 4)]  # one get_slice read of exactly a quarter of the elements


def test_read_slice_errors(saved):
    _, single, _ = saved
    with open_checkpoint(single) as checkpoint:
        with pytest.raises(CheckpointError, match=r"size 32 along dim 1.*3 equal parts.*--num-shard"):
            checkpoint.read_slice("model.layers.0.self_attn.q_proj.weight", 1, 0, 3)
        with pytest.raises(CheckpointError, match="dim 1"):
            checkpoint.read_slice("model.norm.weight", 1, 0, 2)
        with pytest.raises(CheckpointError, match="part 2 of 2"):
            checkpoint.read_slice("lm_head.weight", 0, 2, 2)
        with pytest.raises(CheckpointError, match="'nope.weight' is not in the checkpoint"):
            checkpoint.read("nope.weight")


def _shapes(state):
    return {name: tuple(t.shape) for name, t in state.items()}


def test_check_accepts_the_exact_names_and_shapes(saved):
    state, single, sharded = saved
    for path in (single, sharded):
        with open_checkpoint(path) as checkpoint:
            checkpoint.check(_shapes(state))


def test_check_names_missing_unexpected_and_misshaped(saved):
    state, _, sharded = saved
    expected = _shapes(state)
    del expected["model.layers.1.mlp.up_proj.weight"]                       # present but not expected
    expected["model.layers.2.mlp.up_proj.weight"] = (64, 32)                 # expected but absent
    expected["model.layers.0.self_attn.k_proj.weight"] = (32, 32)            # really (16, 32)
    with open_checkpoint(sharded) as checkpoint, pytest.raises(CheckpointError) as caught:
        checkpoint.check(expected)
    message = str(caught.value)
    assert "1 missing: model.layers.2.mlp.up_proj.weight" in message
    assert "1 unexpected: model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight (16, 32) (expected (32, 32))" in message


def test_check_ignores_unexpected_names_that_match(saved):
    state, single, _ = saved
    expected = _shapes(state)
    for layer in range(2):
        del expected[f"model.layers.{layer}.post_attention_layernorm.weight"]
    with open_checkpoint(single) as checkpoint:
        checkpoint.check(expected, ignore_unexpected=(r"post_attention_layernorm\.weight$",))
        with pytest.raises(CheckpointError, match="2 unexpected"):
            checkpoint.check(expected, ignore_unexpected=(r"rotary_emb\.inv_freq$",))


def test_check_truncates_long_lists(saved):
    state, single, _ = saved
    with open_checkpoint(single) as checkpoint, pytest.raises(CheckpointError) as caught:
        checkpoint.check({})
    message = str(caught.value)
    assert f"{len(state)} unexpected" in message and f"({len(state)} in all)" in message
    assert message.count("model.layers.") <= 10


def test_bin_only_directory(tmp_path):
    torch.save({"w": torch.randn(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds only PyTorch \.bin weights; safetensors required: "
                                              r"convert it \(e\.g\. transformers `save_pretrained"):
        open_checkpoint(tmp_path)


def test_missing_directory_and_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="no weights in"):
        open_checkpoint(tmp_path)


def test_index_naming_a_missing_shard(saved, tmp_path):
    _, _, sharded = saved
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    victim = sorted(copy.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"absent.*{victim.name}"):
        open_checkpoint(copy)


def test_shards_without_index_are_read_from_their_headers(saved, tmp_path):
    state, _, sharded = saved
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    (copy / "model.safetensors.index.json").unlink()
    with open_checkpoint(copy) as checkpoint:
        assert checkpoint.names() == sorted(state)
        torch.testing.assert_close(checkpoint.read("lm_head.weight"), state["lm_head.weight"], rtol=0, atol=0)


def test_progress_shows_one_bar_and_yields_every_name(saved, capsys):
    _, single, _ = saved
    with open_checkpoint(single) as checkpoint:
        names = checkpoint.names()
        assert list(checkpoint.progress(names, desc="Loading weights (shard 0)")) == names
    err = capsys.readouterr().err
    assert "Loading weights (shard 0)" in err and f"{len(names)}/{len(names)}" in err


def test_close_drops_handles(saved):
    _, _, sharded = saved
    with open_checkpoint(sharded) as checkpoint:
        checkpoint.read("lm_head.weight")
        assert checkpoint._handles
    assert not checkpoint._handles


def test_read_config(saved, tmp_path):
    _, single, _ = saved
    assert read_config(single)["hidden_size"] == 32
    with pytest.raises(CheckpointError, match="config.json not found"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(tmp_path)


def _save_tensors(directory, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_a_nan_or_infinite_weight_is_a_load_error_that_names_the_tensor(tmp_path):
    good = torch.randn(8, 6)
    nan, inf = good.clone(), good.clone()
    nan[5, 1] = float("nan")
    inf[0, 0], inf[7, 5] = float("inf"), float("-inf")
    directory = _save_tensors(tmp_path / "ckpt", {"good": good, "a.nan": nan, "b.inf": inf})
    checkpoint = open_checkpoint(directory)
    for _ in checkpoint.progress(["good"]):
        torch.testing.assert_close(checkpoint.read("good"), good, rtol=0, atol=0)
    # a tensor-parallel rank checks what it reads: the part with the NaN, not the other
    for _ in checkpoint.progress(["a.nan"]):
        checkpoint.read_slice("a.nan", 0, 0, 2)
        checkpoint.read_rows("a.nan", 0, 5)
    for read in (lambda: checkpoint.read("a.nan"), lambda: checkpoint.read_slice("a.nan", 0, 1, 2),
                 lambda: checkpoint.read_slice("a.nan", 1, 0, 2), lambda: checkpoint.read_rows("a.nan", 5, 8)):
        with pytest.raises(CheckpointError, match=r"^tensor 'a\.nan' holds NaN or infinite values \(1 where this "
                                                  r"shard read it as float32\): the checkpoint is broken"):
            for _ in checkpoint.progress(["a.nan"]):      # the loading loop: the error comes after its last name
                read()
    with pytest.raises(CheckpointError, match=r"'b\.inf' holds NaN or infinite values \(2 where this shard read "
                                              r"it as bfloat16\).* 2 tensors hold such values: b\.inf, a\.nan\.$"):
        with checkpoint:                                 # or when the checkpoint closes
            checkpoint.read("b.inf", dtype=torch.bfloat16)
            checkpoint.read("a.nan")
    with pytest.raises(RuntimeError, match="the loader's own error"), checkpoint:
        checkpoint.read("a.nan")                         # an error on its way is not replaced
        raise RuntimeError("the loader's own error")
    checkpoint.verify_finite()                           # and what it dropped is not raised later


def test_values_that_overflow_the_serving_dtype_say_which_dtype_holds_them(tmp_path):
    big = torch.ones(4, 4, dtype=torch.bfloat16)
    big[1, 2], big[3, 3] = 1.0e5, -3.0e5            # finite in bfloat16, beyond float16's 65504
    with open_checkpoint(_save_tensors(tmp_path / "ckpt", {"w": big})) as checkpoint:
        torch.testing.assert_close(checkpoint.read("w", dtype=torch.float32), big.float(), rtol=0, atol=0)
        checkpoint.verify_finite()
        checkpoint.read("w", dtype=torch.float16)
        with pytest.raises(CheckpointError, match=r"^tensor 'w' holds 2 values that are infinite in float16: the "
                                                  r"checkpoint stores them in bfloat16 \(largest magnitude "
                                                  r"2\.99e\+05\)\. Serve it in a dtype that holds them \(--dtype "
                                                  r"bfloat16 or float32\)\.$"):
            checkpoint.verify_finite()


def test_float8_weights_are_checked_and_integer_ones_are_not(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "_FINITE_CHUNK", 5)        # several chunks per tensor
    fp8 = torch.linspace(-448, 448, 24).to(torch.float8_e4m3fn)
    broken = fp8.clone()
    broken.view(torch.uint8)[[3, 17]] = 0x7F                          # e4m3fn's NaN: it has no infinity
    packed = torch.randint(-2**31, 2**31 - 1, (6, 4), dtype=torch.int32)   # GPTQ/AWQ nibbles: any bits are values
    directory = _save_tensors(tmp_path / "ckpt", {"fp8": fp8, "broken": broken, "qweight": packed})
    with open_checkpoint(directory) as checkpoint:
        assert torch.equal(checkpoint.read("fp8").view(torch.uint8), fp8.view(torch.uint8))
        assert torch.equal(checkpoint.read("qweight"), packed)
        checkpoint.verify_finite()
        checkpoint.read("broken")
        with pytest.raises(CheckpointError, match=r"'broken' holds NaN or infinite values \(2 where this shard "
                                                  r"read it as float8_e4m3fn\)"):
            checkpoint.verify_finite()
    assert checkpoint_module.count_non_finite(torch.full((23,), float("nan"))).item() == 23
    assert checkpoint_module.count_non_finite(torch.empty(0)).item() == 0
