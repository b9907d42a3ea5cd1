"""The worker's start-up run of the prefill-attention variants that plain prompts do not reach."""
import torch

from engine.ops import TorchOps
from engine.worker import model_worker
from engine.worker.model_worker import ModelWorker, WorkerConfig
from tests.tiny_models import save_tiny_model


def test_the_warm_up_reaches_a_shared_prefix_long_split_keys_and_both_then_leaves_nothing(tmp_path, monkeypatch):
    path = save_tiny_model("llama", tmp_path / "llama")
    worker = ModelWorker(WorkerConfig(model_dir=str(path), dtype=torch.float32, device=torch.device("cpu"),
                                      kernel_backend="torch", max_requests=16, max_seq_len=512, num_slots=1024))
    seen = []
    original = TorchOps.prefill_attention

    def recording(self, q, kv, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale, max_q_len, shared=None,
                  max_seq_len=None, **rest):
        seen.append((shared is not None, max_seq_len))
        return original(self, q, kv, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale, max_q_len,
                        shared=shared, max_seq_len=max_seq_len, **rest)

    monkeypatch.setattr(TorchOps, "prefill_attention", recording)
    monkeypatch.setattr(model_worker, "MIN_SPLIT_KEYS", 64)      # "long": 128 keys on this tiny model
    worker._compile_attention_variants()
    variants = set(seen)
    assert (True, 16 + 4) in variants               # chunks behind a shared prefix
    assert (True, 128 + 4) in variants              # ... whose keys are long enough to split
    assert (False, 128 + 4) in variants             # one long row alone: split keys, no shared prefix
    assert worker._sampling == {}                   # every warm-up request released
