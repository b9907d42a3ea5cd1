"""bench.spec_bench verify on the CPU: a tiny random checkpoint, batch sizes 1 and 32 (no timing assertion)."""
from argparse import Namespace

from bench import spec_bench
from tests.tiny_models import save_tiny_model


def test_verify_runs_every_batch_size_with_its_contexts_in_the_kv_cache(tmp_path):
    """The bench sizes the worker's KV cache for its largest batch (the GPU run's batch 32 ran out of slots):
    on a CPU the worker gets exactly that many slots, so one too few would fail here."""
    model_dir = save_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024,
                                vocab_size=1024)   # the fixtures feed token ids up to 1009
    result = spec_bench.verify(Namespace(model_dir=str(model_dir), batch_sizes="1,32", context=128, repeats=2))
    assert [r["batch_size"] for r in result["verify"]] == [1, 32]
    assert all(r["decode_ms"] > 0 and r["verify4_ms"] > 0 for r in result["verify"])
