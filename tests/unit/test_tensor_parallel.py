"""Tensor parallelism on the CPU (gloo): TP=2 equals TP=1, and each rank reads only its slices.

Two shards sum the row-parallel projections' partial products in another order than one, so their float32
logprobs may differ in the last bits: ``same_outputs`` compares tokens exactly and logprobs within a tolerance
(rounded logprobs compared for equality fail where a value sits at a rounding boundary, as one did on one CPU)."""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import build_model, family_for, load_model_config
from engine.models.llama import LlamaFamilyModel
from engine.ops import KernelOps
from engine.models.parallel import ShardingError, TensorParallel
from tests.e2e.server import free_port
from tests.tiny_models import save_tiny_model
from weights.checkpoint import open_checkpoint

PROMPTS = [[5, 9, 11], list(range(3, 40)), [7], list(range(100, 120))]
LOGPROB_TOL = 1e-4      # a float cache: float32 sums in another order


def far(x, y, tol: float = LOGPROB_TOL) -> bool:
    """Two (token, logprob) pairs differ: another token, or logprobs more than ``tol`` apart."""
    return x[0] != y[0] or abs(x[1] - y[1]) > tol


def same_outputs(a, b, tol: float = LOGPROB_TOL) -> bool:
    """Two ``generate`` outputs hold the same tokens, with logprobs within ``tol``."""
    return a.keys() == b.keys() and all(
        len(a[i]) == len(b[i]) and not any(far(x, y, tol) for x, y in zip(a[i], b[i])) for i in a)


def generate(path, num_shards, backend="torch", prompts=PROMPTS, new_tokens=16, **more):
    config = EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=400, max_requests=8,
                          max_prefill_tokens=16, num_shards=num_shards, master_port=free_port(), **more)
    with Engine(config) as engine:
        out = engine.generate([GenerationRequest(i, p, new_tokens, stop_token_ids=[]) for i, p in enumerate(prompts)])
        assert engine.kv_usage()[0] == 0
    return {i: [(e.token_id, e.logprob) for e in events] for i, events in out.items()}


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "gemma2", "phi3", "starcoder2", "mixtral",
                                    "qwen2_moe", "bloom"])
def test_two_shards_give_the_same_tokens_as_one(family, tmp_path):
    """llama: MHA; llama3: GQA with as many KV heads as shards; qwen2: 1 KV head (replicated) + biases;
    gemma2: sliding window and soft-caps per shard, the final soft-cap on the gathered logits;
    phi3: fused qkv_proj / gate_up_proj sliced per part; starcoder2: row-parallel biases added once;
    mixtral: each expert sliced like the gated MLP, the router replicated; qwen2_moe: the shared
    expert's partial output summed with the experts' by one all-reduce, a dense layer; bloom: interleaved
    query_key_value split by whole heads, each shard's 3 of the 6 heads' ALiBi slopes."""
    path = save_tiny_model(family, tmp_path / family)
    assert same_outputs(generate(path, 2), generate(path, 1))


def test_two_shards_of_the_one_token_moe_kernels_give_the_same_tokens_as_one(tmp_path):
    """A lone request of Qwen2-MoE through the Triton kernels (the interpreter here): its decode steps
    take fused_moe's one-token path, each shard with its slice of every expert and of the shared
    expert, whose gated partial outputs the all-reduce sums (4 tokens: three decode steps)."""
    path = save_tiny_model("qwen2_moe", tmp_path / "qwen2_moe")
    lone = [[5, 9, 11, 40]]
    assert same_outputs(generate(path, 2, "triton", lone, 4), generate(path, 1, "triton", lone, 4))


def test_two_shards_through_the_context_path_give_the_same_tokens_as_one(tmp_path):
    """A 40-token prompt in 16-token chunks whose later chunks attend to their first 16 and 32 keys through
    ``kernels.context_attention`` (bucket 16, piece 8; the CPU's torch stand-in for cuDNN), each shard with its
    own heads (llama3: one of the two KV heads each): TP=2 gives TP=1's tokens, which are those of the path off."""
    path = save_tiny_model("llama3", tmp_path / "llama3")
    lone = [list(range(3, 43))]
    one = generate(path, 1, "triton", lone, 3, context_attention=(16, 8))
    assert same_outputs(generate(path, 2, "triton", lone, 3, context_attention=(16, 8)), one)
    assert same_outputs(generate(path, 1, "triton", lone, 3, context_attention=None), one)


class CountingCheckpoint:
    """Wraps a checkpoint and counts the elements each read returns."""

    def __init__(self, inner):
        self.inner, self.elements, self.full_reads = inner, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, name, **kw):
        tensor = self.inner.read(name, **kw)
        self.elements += tensor.numel()
        self.full_reads.append(name)
        return tensor

    def read_slice(self, name, *args, **kw):
        tensor = self.inner.read_slice(name, *args, **kw)
        self.elements += tensor.numel()
        return tensor


def load_rank(path, rank, world):
    config = load_model_config(path)
    model = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel(rank, world))
    with open_checkpoint(path) as checkpoint:
        counting = CountingCheckpoint(checkpoint)
        model.load_weights(counting)
    return model, counting


@pytest.mark.parametrize("family", ["llama3", "qwen2", "phi3"])
def test_shards_concatenate_to_the_full_weights_and_read_only_their_slices(family, tmp_path):
    path = save_tiny_model(family, tmp_path / family)
    full, full_count = load_rank(path, 0, 1)
    shards = [load_rank(path, r, 2) for r in range(2)]
    (a, ca), (b, cb) = shards
    assert torch.equal(torch.cat([a.embed_tokens.weight, b.embed_tokens.weight]), full.embed_tokens.weight)
    assert torch.equal(torch.cat([a.lm_head.weight, b.lm_head.weight]), full.lm_head.weight)
    q = a.num_heads * full.config.head_dim
    kv_size = a.num_kv_heads * full.config.head_dim
    for la, lb, lf in zip(a.layers, b.layers, full.layers):
        assert torch.equal(torch.cat([la.attention.o.weight, lb.attention.o.weight], dim=1), lf.attention.o.weight)
        assert torch.equal(torch.cat([la.mlp.down.weight, lb.mlp.down.weight], dim=1), lf.mlp.down.weight)
        inter = la.mlp.gate_up.weight.shape[0] // 2
        gate = torch.cat([la.mlp.gate_up.weight[:inter], lb.mlp.gate_up.weight[:inter]])
        assert torch.equal(gate, lf.mlp.gate_up.weight[: 2 * inter])
        qkv_a, qkv_b, qkv_f = la.attention.qkv, lb.attention.qkv, lf.attention.qkv
        assert torch.equal(torch.cat([qkv_a.weight[:q], qkv_b.weight[:q]]), qkv_f.weight[: 2 * q])
        if full.config.num_kv_heads >= 2:
            k = torch.cat([qkv_a.weight[q : q + kv_size], qkv_b.weight[q : q + kv_size]])
            assert torch.equal(k, qkv_f.weight[2 * q : 2 * q + 2 * kv_size])
        else:   # one KV head, replicated on both ranks
            assert torch.equal(qkv_a.weight[q:], qkv_f.weight[2 * q :])
            assert torch.equal(qkv_b.weight[q:], qkv_f.weight[2 * q :])
        if qkv_f.bias is not None:
            assert torch.equal(torch.cat([qkv_a.bias[:q], qkv_b.bias[:q]]), qkv_f.bias[: 2 * q])
    # only norms are read whole; every rank reads about half of the weights
    assert all("norm" in name for name in ca.full_reads + cb.full_reads)
    assert ca.elements < 0.62 * full_count.elements and cb.elements < 0.62 * full_count.elements


def test_phi3_fused_tensors_give_each_rank_its_q_k_v_heads_and_gate_up_parts(tmp_path):
    """The fused checkpoint rows q | k | v and gate | up: rank r holds q heads 2r, 2r+1, KV head r,
    and half r of gate and of up (an equal split of the fused rows would give rank 0 only q)."""
    path = save_tiny_model("phi3", tmp_path / "phi3")       # 4 q heads, 2 KV heads, head_dim 16
    with open_checkpoint(path) as checkpoint:
        qkv = checkpoint.read("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = checkpoint.read("model.layers.1.mlp.gate_up_proj.weight")
    q, k, v = qkv.split([64, 32, 32])
    gate, up = gate_up.chunk(2)
    for rank in range(2):
        layer = load_rank(path, rank, 2)[0].layers[1]
        expected_qkv = torch.cat([q[32 * rank: 32 * rank + 32], k[16 * rank: 16 * rank + 16],
                                  v[16 * rank: 16 * rank + 16]])
        assert torch.equal(layer.attention.qkv.weight, expected_qkv)
        assert torch.equal(layer.mlp.gate_up.weight, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


def test_a_model_that_does_not_divide_is_refused(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")   # 4 heads
    with pytest.raises(ShardingError, match="num_attention_heads=4 does not divide over --num-shard 3"):
        TensorParallel(0, 3).check(load_model_config(path))


def test_experts_are_sliced_like_the_gated_mlp_and_the_router_replicated(tmp_path):
    """Mixtral on two shards: each expert's gate/up rows and down columns concatenate to the
    full expert; the router is whole on both; each rank reads about half of the weights."""
    path = save_tiny_model("mixtral", tmp_path / "mixtral")
    config = load_model_config(path)
    family = family_for(config.architecture)

    def load(rank, world):
        model = family.model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel(rank, world))
        with open_checkpoint(path) as checkpoint:
            counting = CountingCheckpoint(checkpoint)
            model.load_weights(counting)
        return model, counting

    (full, full_count), (a, ca), (b, cb) = load(0, 1), load(0, 2), load(1, 2)
    inter = config.moe_intermediate_size // 2
    for la, lb, lf in zip(a.layers, b.layers, full.layers):
        ma, mb, mf = la.mlp, lb.mlp, lf.mlp
        assert torch.equal(ma.router, mf.router) and torch.equal(mb.router, mf.router)
        gate = torch.cat([ma.w_gate_up[:, :inter], mb.w_gate_up[:, :inter]], dim=1)
        up = torch.cat([ma.w_gate_up[:, inter:], mb.w_gate_up[:, inter:]], dim=1)
        assert torch.equal(torch.cat([gate, up], dim=1), mf.w_gate_up)
        assert torch.equal(torch.cat([ma.w_down, mb.w_down], dim=2), mf.w_down)
    assert all("norm" in name or name.endswith(".gate.weight") for name in ca.full_reads + cb.full_reads)
    assert ca.elements < 0.62 * full_count.elements and cb.elements < 0.62 * full_count.elements
