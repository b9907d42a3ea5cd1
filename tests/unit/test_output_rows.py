"""The last layer narrowed to the tokens a step reads (``forward_batch.OutputRows``): a prompt chunk that samples
nothing runs its last layer's attention on one token, a finishing prompt on its last token, and the tokens and
logprobs are those of the full forward for every family's forward loop (float32, tiny checkpoints)."""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.ops import TorchOps
from engine.protocol.messages import SamplingParams
from engine.worker.forward_batch import ForwardBatch, output_rows
from engine.worker.model_worker import ModelWorker
from tests.tiny_models import save_tiny_model


def test_output_rows_are_each_rows_last_tokens():
    lengths = [3, 1, 4]
    starts = [0, 3, 4]
    t = torch.arange(8)
    batch = ForwardBatch(input_ids=t + 100, positions=t + 10, out_slots=t + 50, req_rows=torch.tensor([5, 6, 7]),
                         q_start=torch.tensor(starts), q_len=torch.tensor(lengths), seq_len=torch.tensor([9, 4, 4]),
                         max_q_len=4, is_decode=False)
    out = output_rows(batch, starts, lengths, [1, 0, 2])
    assert out.index.tolist() == [2, 6, 7]
    b = out.batch
    assert b.q_start.tolist() == [0, 1, 1] and b.q_len.tolist() == [1, 0, 2] and b.max_q_len == 2
    assert b.input_ids.tolist() == [102, 106, 107] and b.positions.tolist() == [12, 16, 17]
    assert b.out_slots.tolist() == [52, 56, 57] and b.seq_len.tolist() == [9, 4, 4] and not b.is_decode


def run(path, narrowed: bool, monkeypatch, prompts, params=None):
    """Greedy tokens and logprobs of ``prompts`` together (16-token chunks), with or without the narrowing."""
    if not narrowed:
        real = ModelWorker._forward_batch
        monkeypatch.setattr(ModelWorker, "_forward_batch", lambda self, step, read=None: real(self, step))
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=400,
                                 max_requests=4, max_prefill_tokens=16))
    try:
        requests = [GenerationRequest(i, p, 6, params or SamplingParams(), stop_token_ids=[])
                    for i, p in enumerate(prompts)]
        out = engine.generate(requests)
        return {i: [(e.token_id, e.logprob) for e in events] for i, events in out.items()}
    finally:
        monkeypatch.undo()


PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71))]


@pytest.mark.parametrize("family", ["llama3", "gemma2", "bloom", "starcoder2", "qwen3_moe"])
def test_narrowed_last_layer_gives_the_full_forwards_tokens_and_logprobs(family, tmp_path, monkeypatch):
    path = save_tiny_model(family, tmp_path / family)
    full = run(path, False, monkeypatch, PROMPTS)
    narrowed = run(path, True, monkeypatch, PROMPTS)
    assert full.keys() == narrowed.keys()
    for key in full:
        assert [t for t, _ in narrowed[key]] == [t for t, _ in full[key]], key
        assert [x for _, x in narrowed[key]] == pytest.approx([x for _, x in full[key]], abs=1e-5), key


def test_the_last_layer_attends_only_for_the_tokens_a_step_reads(tmp_path, monkeypatch):
    """Attention calls of the last layer (of 2) see 1 query token for a 16-token chunk that samples nothing and
    for the chunk that ends the prompt; the first layer sees every token. With prompt logprobs asked, every
    position is read: nothing is narrowed."""
    path = save_tiny_model("llama", tmp_path / "llama")
    calls = []
    real = TorchOps.prefill_attention
    monkeypatch.setattr(TorchOps, "prefill_attention",
                        lambda self, q, *a, **k: calls.append(q.shape[0]) or real(self, q, *a, **k))
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=400,
                                 max_requests=4, max_prefill_tokens=16))
    engine.generate([GenerationRequest(1, list(range(3, 40)), 1, stop_token_ids=[])])   # 37 tokens: 16 + 16 + 5
    assert calls == [16, 1, 16, 1, 5, 1]
    calls.clear()
    engine.generate([GenerationRequest(2, list(range(3, 23)), 1, SamplingParams(prompt_logprobs=True),
                                       stop_token_ids=[])])
    assert calls == [16, 16, 4, 4]
