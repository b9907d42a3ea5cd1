"""When a worker hands prompt chunks' long contexts to cuDNN (``engine.worker.model_worker.context_attention_applies``)."""
import pytest
import torch

from engine.models.layers import Attention
from engine.worker.model_worker import WorkerConfig, context_attention_applies
from kernels.score_mods import ScoreMods


def blocks(*mods, head_dim=128):
    return [Attention(qkv=None, o=None, num_heads=4, num_kv_heads=2, head_dim=head_dim, sm_scale=1.0, mods=m)
            for m in mods]


def config(device="cuda", dtype=torch.bfloat16, context=(4096, 1024)):
    return WorkerConfig(model_dir="m", dtype=dtype, device=torch.device(device), kernel_backend="triton",
                        max_requests=4, max_seq_len=32768, context_attention=context)


@pytest.mark.parametrize("cfg,kv_dtype,model,backend,applies", [
    (config(), torch.bfloat16, blocks(None, None), "triton", True),
    (config(dtype=torch.float16), torch.float16, blocks(ScoreMods(), None), "triton", True),
    (config(context=None), torch.bfloat16, blocks(None), "triton", False),           # asked off
    (config(), torch.bfloat16, blocks(None), "torch", False),                         # --disable-custom-kernels
    (config(), torch.int8, blocks(None), "triton", False),                            # a quantized KV cache
    (config(dtype=torch.float32), torch.float32, blocks(None), "triton", False),      # cuDNN: half precision only
    (config(), torch.bfloat16, blocks(None, head_dim=256), "triton", False),          # a head dim cuDNN refuses
    (config(), torch.bfloat16, blocks(None, head_dim=96), "triton", True),
    # Gemma 2: every layer soft-caps (and every other one has a window): no layer would take it
    (config(), torch.bfloat16, blocks(ScoreMods(window=4096, softcap=50.0), ScoreMods(softcap=50.0)), "triton", False),
    # a window on some layers only (the others take it; the windowed ones walk every key in the kernel)
    (config(), torch.bfloat16, blocks(ScoreMods(window=4096), None), "triton", True),
    (config(device="cpu", dtype=torch.float32), torch.float32, blocks(None, head_dim=256), "triton", True),
])
def test_the_context_path_applies_where_cudnn_can_run_it(cfg, kv_dtype, model, backend, applies):
    assert context_attention_applies(cfg, kv_dtype, model, backend) is applies


@pytest.mark.parametrize("error,said", [
    (RuntimeError("cuDNN Frontend error: No valid execution plans built.\nmore"),
     "cuDNN Frontend error: No valid execution plans built."),
    (AttributeError("'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_cudnn_attention'"),
     "'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_cudnn_attention'")])
def test_a_cudnn_that_refuses_the_shapes_leaves_the_prefill_kernel_every_key(tmp_path, monkeypatch, caplog, error,
                                                                             said):
    """The worker builds every shape at startup; a refusal there (or a torch without the op) is one warning, and the
    engine serves as before."""
    from engine.generation import Engine, EngineConfig, GenerationRequest
    from kernels.context_attention import ContextAttention
    from tests.tiny_models import save_tiny_model

    def refuse(self):
        raise error

    monkeypatch.setattr(ContextAttention, "warm", refuse)
    path = save_tiny_model("llama3", tmp_path / "llama3")
    with caplog.at_level("WARNING", logger="engine.worker.model_worker"):
        engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="triton", num_slots=256,
                                     dtype="float32", max_requests=2, max_prefill_tokens=32, context_attention=(32, 16)))
    assert engine.worker.context_attention is None
    assert f"long prompt contexts: cuDNN's attention refused them ({said}); the prefill kernel walks every key" \
        in caplog.text
    out = engine.generate([GenerationRequest(0, list(range(3, 83)), 2, stop_token_ids=[])])[0]
    assert len(out) == 2 and engine.kv_usage()[0] == 0


@pytest.mark.parametrize("value", [(0, 16), (16,), (16, -1), [4096, 1024], (4096.0, 1024), (True, 8), "on"])
def test_a_bad_context_attention_setting_is_refused_before_any_process(tmp_path, value):
    """Refused by ``plan_engine`` on any device, not only where the path would apply and read it."""
    from engine.assembly import plan_engine
    from engine.generation import EngineConfig
    from tests.tiny_models import save_tiny_model

    path = save_tiny_model("llama3", tmp_path / "llama3")
    with pytest.raises(ValueError, match=r"^context_attention must be None \(off\) or \(bucket, piece\), two positive "
                                         r"ints: .* got "):
        plan_engine(EngineConfig(model_dir=str(path), device="cpu", context_attention=value))
    assert plan_engine(EngineConfig(model_dir=str(path), device="cpu", context_attention=None)).worker \
        .context_attention is None
