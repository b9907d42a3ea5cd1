"""The GEMMs run once at every row count a step can give them (``engine.worker.gemm_warmup``): the warmed counts
cover every eager step's padded token count, ``gemm_weights`` finds every weight a forward multiplies by (each
family, quantized and Medusa weights too), and a step padded with a row of its own gives the tokens and
logprobs of the step without it (float32, tiny checkpoints)."""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models.layers import gemm_key, gemm_weights
from engine.ops import TorchOps, TritonOps
from engine.protocol.messages import SamplingParams
from engine.worker import gemm_warmup
from engine.worker.gemm_warmup import ROW_GRANULE, padded_tokens, warm_gemms, warm_row_counts
from tests.tiny_models import save_tiny_model


@pytest.mark.parametrize("max_rows", [1, 100, 1024, 1025, 1040, 4095, 4096, 5000])
def test_every_padded_token_count_is_warmed(max_rows):
    counts = warm_row_counts(max_rows)
    assert counts == sorted(set(counts)) and counts[0] == 1
    assert counts[-1] == padded_tokens(max_rows)
    warmed = set(counts)
    for tokens in range(1, max_rows + 1):
        padded = padded_tokens(tokens)
        assert padded in warmed and 0 <= padded - tokens < ROW_GRANULE
        assert padded == tokens if tokens <= gemm_warmup.EXACT_ROWS else padded % ROW_GRANULE == 0


def test_warm_gemms_multiplies_by_each_weight_at_each_count():
    calls = []

    class Recording(TorchOps):
        def linear(self, x, weight, bias=None):
            calls.append((tuple(weight.shape), tuple(x.shape)))
            return super().linear(x, weight, bias)

    weights = [torch.ones(3, 5), torch.ones(7, 2)]
    warm_gemms(Recording(), weights, 1030, torch.float32, torch.device("cpu"))
    expected = [((n, k), (m, k)) for n, k in ((3, 5), (7, 2)) for m in warm_row_counts(1030)]
    assert calls == expected and expected[-1] == ((7, 2), (1040, 2))


def products(engine: Engine, prompts, monkeypatch) -> set:
    """The ``gemm_key`` of every weight ``ops.linear`` multiplies by while ``engine`` serves ``prompts``."""
    seen = set()
    real = TorchOps.linear
    monkeypatch.setattr(TorchOps, "linear", lambda self, x, w, b=None: seen.add(gemm_key(w)) or real(self, x, w, b))
    engine.generate([GenerationRequest(i, p, 4, stop_token_ids=[]) for i, p in enumerate(prompts)])
    return seen


@pytest.mark.parametrize("family", ["llama3", "gemma2", "phi3", "bloom", "starcoder2", "qwen2_moe", "qwen3_moe"])
def test_gemm_weights_hold_every_weight_a_forward_multiplies_by(family, tmp_path, monkeypatch):
    path = save_tiny_model(family, tmp_path / family)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=400,
                                 max_requests=4, max_prefill_tokens=16))
    used = products(engine, [list(range(3, 40)), [5, 6, 7]], monkeypatch)
    found = {gemm_key(w) for w in gemm_weights(engine.worker.model)}
    assert used and used <= found
    assert len(found) == len(gemm_weights(engine.worker.model))        # one weight a key


def test_gemm_weights_walk_lists_tuples_dicts_and_nested_blocks():
    """As Medusa's ``DraftHeads`` holds its blocks (a list of lists) beside the model: every block is found, each
    (format, shape, dtype) once, and a tensor outside a block's ``GEMM_FIELDS`` (a norm, a bias) is not."""
    from engine.models.layers import Linear, LMHead
    from engine.models.parallel import TensorParallel

    class Holder:           # an engine object (the walk follows objects of the engine's modules)
        pass

    Holder.__module__ = "engine.test_holder"
    inner, outer = Holder(), Holder()
    inner.blocks = [[Linear(torch.ones(3, 4), torch.ones(3))], (Linear(torch.ones(5, 4)),)]
    inner.norm = torch.ones(4)
    outer.by_name = {"head": LMHead(torch.ones(9, 4), TensorParallel()), "same": Linear(torch.ones(3, 4))}
    outer.inner, inner.outer = inner, outer                               # a cycle
    keys = [gemm_key(w) for w in gemm_weights(outer)]
    assert sorted(k[1] for k in keys) == [(3, 4), (5, 4), (9, 4)]
    assert gemm_weights(torch.ones(3, 4), "text", None) == []


def run(path, monkeypatch, padded: bool, backend="torch"):
    """Tokens, logprobs and the attention's token counts of three prompts (one 40-token prompt in 16-token
    chunks beside two shorter ones), eager steps padded past 8 tokens or not at all."""
    monkeypatch.setattr(gemm_warmup, "EXACT_ROWS", 8 if padded else 10**9)
    counts = []
    ops = TorchOps if backend == "torch" else TritonOps
    real = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda self, q, *a, **k: counts.append(q.shape[0]) or
                        real(self, q, *a, **k))
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=400,
                                 max_requests=4, max_prefill_tokens=16))
    params = SamplingParams(top_n_tokens=2)
    prompts = [list(range(3, 43)), [5, 6, 7, 8, 9], list(range(50, 61))]
    out = engine.generate([GenerationRequest(i, p, 5, params, stop_token_ids=[]) for i, p in enumerate(prompts)])
    monkeypatch.undo()
    return {i: [(e.token_id, e.logprob, e.top_ids) for e in events] for i, events in out.items()}, counts


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        assert [e[0] for e in got[key]] == [e[0] for e in expected[key]], key
        assert [e[1] for e in got[key]] == pytest.approx([e[1] for e in expected[key]], abs=1e-5), key
        assert [e[2] for e in got[key]] == [e[2] for e in expected[key]], key


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "bloom"])
def test_a_padded_step_gives_the_unpadded_steps_tokens_and_logprobs(family, tmp_path, monkeypatch):
    path = save_tiny_model(family, tmp_path / family)
    plain, plain_counts = run(path, monkeypatch, padded=False)
    padded, padded_counts = run(path, monkeypatch, padded=True)
    assert_same(padded, plain)
    # the first layer's attention of each prompt step sees the padded tokens: multiples of 16 past 8 tokens
    grown = [(a, b) for a, b in zip(plain_counts, padded_counts) if a != b]
    assert grown and all(a > 8 and b == -(-a // ROW_GRANULE) * ROW_GRANULE for a, b in grown)


def test_a_padded_step_through_the_triton_kernels(tmp_path, monkeypatch):
    path = save_tiny_model("llama3", tmp_path / "llama3")
    plain, _ = run(path, monkeypatch, padded=False, backend="triton")
    padded, counts = run(path, monkeypatch, padded=True, backend="triton")
    assert_same(padded, plain)
    assert any(c > 8 and c % ROW_GRANULE == 0 for c in counts)


def test_no_padding_row_longer_than_a_request_may_be(tmp_path, monkeypatch):
    """Requests of at most 8 tokens (``max_seq_len``) in a step of 18 tokens: 14 padding tokens would not fit a
    ``req_to_token`` row, so the step runs unpadded (and gives the tokens it gives unpadded)."""
    path = save_tiny_model("llama", tmp_path / "llama")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18], [19, 20, 21, 22]]

    def generate(exact_rows):
        monkeypatch.setattr(gemm_warmup, "EXACT_ROWS", exact_rows)
        engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=100,
                                     max_requests=4, max_seq_len=8, max_prefill_tokens=32))
        out = engine.generate([GenerationRequest(i, p, 3, stop_token_ids=[]) for i, p in enumerate(prompts)])
        return {i: [(e.token_id, e.logprob) for e in events] for i, events in out.items()}

    padded, plain = generate(8), generate(10**9)
    assert padded.keys() == plain.keys()
    for key in plain:
        assert [t for t, _ in padded[key]] == [t for t, _ in plain[key]]
        assert [x for _, x in padded[key]] == pytest.approx([x for _, x in plain[key]], abs=1e-5)


def test_a_product_out_of_memory_warms_that_weight_no_further(caplog):
    """The second weight's products fail past 500 rows: a warning names it, and the third is warmed in full."""
    calls = []

    class Tight(TorchOps):
        def linear(self, x, weight, bias=None):
            if weight.shape[0] == 7 and x.shape[0] > 500:
                raise torch.OutOfMemoryError("CUDA out of memory")
            calls.append((weight.shape[0], x.shape[0]))
            return super().linear(x, weight, bias)

    weights = [torch.ones(3, 5), torch.ones(7, 2), torch.ones(9, 2)]
    with caplog.at_level("WARNING", logger="engine.worker.gemm_warmup"):
        warm_gemms(Tight(), weights, 1030, torch.float32, torch.device("cpu"))
    counts = warm_row_counts(1030)
    assert [m for n, m in calls if n == 3] == counts and [m for n, m in calls if n == 9] == counts
    assert [m for n, m in calls if n == 7] == list(range(1, 501))
    assert "(7, 2) warmed up to 500 rows only (out of memory)" in caplog.text
