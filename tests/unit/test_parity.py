"""Greedy tokens and logprobs of the engine equal transformers' on tiny checkpoints."""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import FED_BACK, SamplingParams
from tests.tiny_models import FAMILIES, load_hf, save_tiny_model

NEW_TOKENS = 32
PROMPT_LENGTHS = [5, 17, 1, 33]
# On a GPU the same tests run the Triton kernels, in float32 like the reference (the GPU's
# default for a float32 checkpoint is bfloat16, whose rounding would flip tokens of a random model).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGPROB_TOL = {"torch": 1e-4, "triton": 1e-3}
# Every Triton kernel under the CPU's interpreter costs minutes a family at 32 tokens; 8 still decode past the
# late joiners' prefill (they join at step 4, prefill in steps 4 and 5; steps 6 and 7 decode all four rows) (the
# GPU runs the kernels natively, for all 32).
KERNEL_NEW_TOKENS = NEW_TOKENS if DEVICE == "cuda" else 8


def prompts(vocab=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_reference(hf, prompt, new_tokens=NEW_TOKENS):
    out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=new_tokens, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return tokens, logprobs


def run_engine_with_late_joiners(engine, all_prompts, new_tokens=NEW_TOKENS):
    """Requests 0 and 1 start; 2 and 3 join after three decode steps."""
    params = SamplingParams(top_n_tokens=3)
    request = lambda i: GenerationRequest(i, all_prompts[i], new_tokens, params, stop_token_ids=[])  # noqa: E731
    outputs = {i: [] for i in range(len(all_prompts))}
    for i in (0, 1):
        engine.add_request(request(i))
    steps = 0
    while engine.has_work() or steps < 4:
        if steps == 4:
            for i in (2, 3):
                engine.add_request(request(i))
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
    return outputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_and_logprobs_match_transformers(family, tmp_path):
    path = save_tiny_model(family, tmp_path / family)
    hf = load_hf(path).to(DEVICE)
    backend = "torch" if DEVICE == "cpu" else "triton"
    engine = Engine(EngineConfig(model_dir=str(path), device=DEVICE, kernel_backend=backend, num_slots=512,
                                 dtype="float32", max_requests=8, max_prefill_tokens=24))
    all_prompts = prompts()
    outputs = run_engine_with_late_joiners(engine, all_prompts)
    for i, prompt in enumerate(all_prompts):
        tokens, logprobs = hf_reference(hf, prompt)
        ours = outputs[i]
        assert [o.token_id for o in ours] == tokens, f"{family} prompt {i}"
        for o, ref in zip(ours, logprobs):
            assert o.logprob == pytest.approx(ref[o.token_id].item(), abs=LOGPROB_TOL[backend])
            assert o.top_ids == ref.topk(3).indices.tolist()
        assert ours[-1].finish_reason == "length"
    assert engine.kv_usage()[0] == 0
    engine.allocator.check_integrity()


@pytest.mark.parametrize("family", ["llama3", "gemma2", "mixtral", "bloom"])
def test_triton_kernels_under_the_interpreter_match_transformers(tmp_path, family):
    """End to end with every Triton kernel (TRITON_INTERPRET=1 on the CPU); gemma2: window, soft-caps,
    GeLU-tanh in the kernels; mixtral: the fused MoE kernel; bloom: ALiBi in both attention kernels, K stored
    unrotated by the rotary/store kernel, LayerNorm and GeLU kernels."""
    path = save_tiny_model(family, tmp_path / family)
    hf = load_hf(path).to(DEVICE)
    engine = Engine(EngineConfig(model_dir=str(path), device=DEVICE, kernel_backend="triton", num_slots=512,
                                 dtype="float32", max_requests=8, max_prefill_tokens=24))
    all_prompts = prompts(seed=1)
    outputs = run_engine_with_late_joiners(engine, all_prompts, KERNEL_NEW_TOKENS)
    for i, prompt in enumerate(all_prompts):
        tokens, logprobs = hf_reference(hf, prompt, KERNEL_NEW_TOKENS)
        assert len(tokens) == KERNEL_NEW_TOKENS and [o.token_id for o in outputs[i]] == tokens
        for o, ref in zip(outputs[i], logprobs):
            assert o.logprob == pytest.approx(ref[o.token_id].item(), abs=LOGPROB_TOL["triton"])


@pytest.mark.parametrize("budget,rows", [(7, 8), (64, 4)])
def test_prompt_logprobs_match_transformers(tmp_path, budget, rows):
    """(7, 8): the 33-token prompt is prefilled in 5 chunks; (64, 4): in one, its logits formed 4 positions at a
    time (the warm-up's rows: a chunk's [positions, vocab] float32 logits at once could pass the memory it
    measured)."""
    path = save_tiny_model("qwen2", tmp_path / "qwen2")
    hf = load_hf(path)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=256,
                                 max_prefill_tokens=budget, max_requests=rows))
    formed = []
    compute_logits = engine.worker.model.compute_logits
    engine.worker.model.compute_logits = lambda hidden: formed.append(len(hidden)) or compute_logits(hidden)
    prompt = prompts()[3]
    out = engine.generate([GenerationRequest(0, prompt, 2, SamplingParams(prompt_logprobs=True))])[0]
    assert max(formed) <= rows and sum(formed) >= len(prompt) - 1
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    expected = [None] + [ref[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
    got = out[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    assert got[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert out[1].prompt_logprobs is None


def test_requests_behind_a_shared_prefix_match_transformers_through_the_cascade_kernel(tmp_path):
    """Nine requests behind one 70-token prefix (the prefix cache shares its slots): their prompt
    chunks and decode rows attend to it once for all (the shared-prefix kernel), and every token
    is transformers'."""
    path = save_tiny_model("llama3", tmp_path / "llama3")
    hf = load_hf(path).to(DEVICE)
    engine = Engine(EngineConfig(model_dir=str(path), device=DEVICE, kernel_backend="triton", num_slots=1024,
                                 dtype="float32", max_requests=10, max_prefill_tokens=256))
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 384, (70,), generator=g).tolist()
    all_prompts = [prefix + torch.randint(3, 384, (1 + i % 4,), generator=g).tolist() for i in range(9)]
    new_tokens = 3        # the eight later requests' prefill step, then two decode steps of all eight
    request = lambda i: GenerationRequest(i, all_prompts[i], new_tokens, stop_token_ids=[])  # noqa: E731
    marked = []     # (prompt chunks, decode rows) of each step that take the 70-token prefix once
    schedule = engine.router.scheduler.schedule

    def recording_schedule():
        step = schedule()
        shared = [r for r in step.rows if r.shared_prefix_len == 70]       # the prefix; no suffix is shared
        marked.append((sum(r.input_ids[0] != FED_BACK for r in shared), sum(r.input_ids[0] == FED_BACK for r in shared)))
        return step

    engine.router.scheduler.schedule = recording_schedule
    outputs = engine.generate([request(0)])               # caches the prefix
    outputs.update(engine.generate([request(i) for i in range(1, 9)]))
    # the eight later requests prefill their own tokens, then decode, as one group (the first has left)
    assert (8, 0) in marked and max(decode for _, decode in marked) == 8
    for i, prompt in enumerate(all_prompts):
        out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=new_tokens, do_sample=False)
        assert [o.token_id for o in outputs[i]] == out[0, len(prompt):].tolist(), f"request {i}"
    assert engine.kv_usage()[0] == 0
    engine.router.scheduler.check_integrity()


def test_a_long_prompt_joining_decoding_requests_in_stall_free_chunks_matches_transformers(tmp_path):
    """A 150-token prompt arrives while two requests decode: under a 24-token step budget with the
    stall-free cost cap its chunks shrink as its context grows (steps keep the decode rows), and
    every request's tokens are still transformers'."""
    path = save_tiny_model("llama3", tmp_path / "llama3")
    hf = load_hf(path).to(DEVICE)
    backend = "torch" if DEVICE == "cpu" else "triton"
    engine = Engine(EngineConfig(model_dir=str(path), device=DEVICE, kernel_backend=backend, num_slots=1024,
                                 dtype="float32", max_requests=4, max_prefill_tokens=24, stall_free_tokens=40))
    g = torch.Generator().manual_seed(9)
    all_prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 17, 150)]
    chunks = []
    schedule = engine.router.scheduler.schedule

    def recording_schedule():
        step = schedule()
        chunks.extend(len(r.input_ids) for r in step.rows if r.request_id == 2)
        assert sum(len(r.input_ids) for r in step.rows) <= 24
        return step

    engine.router.scheduler.schedule = recording_schedule
    outputs = {i: [] for i in range(3)}
    for i in (0, 1):
        engine.add_request(GenerationRequest(i, all_prompts[i], NEW_TOKENS, stop_token_ids=[]))
    steps = 0
    while engine.has_work():
        if steps == 3:
            engine.add_request(GenerationRequest(2, all_prompts[2], 8, stop_token_ids=[]))
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
        steps += 1
    for i, prompt in enumerate(all_prompts):
        tokens, _ = hf_reference(hf, prompt)
        assert outputs[i] == tokens[: len(outputs[i])] and len(outputs[i]) == (8 if i == 2 else NEW_TOKENS), i
    prompt_chunks = chunks[: len(chunks) - 7]            # then its 7 decode rows
    assert sum(prompt_chunks) == 150 and prompt_chunks[0] > min(prompt_chunks), prompt_chunks


def test_prompt_chunks_behind_long_contexts_match_transformers(tmp_path):
    """An 88-token prompt in chunks of 32, 32 and 24 tokens, the last two behind 32 and 64 keys attending to them
    first through ``kernels.context_attention`` (bucket 32, piece 16; the CPU's torch stand-in for cuDNN), then the
    prefill kernel; the last chunk's tail of 8 tokens (half a piece) walks its context in the kernel: every prompt
    position's logprob and the greedy tokens are transformers'. On a GPU float32 does not take cuDNN:
    the worker has no context path there (``tests/gpu`` runs it in bfloat16)."""
    path = save_tiny_model("llama3", tmp_path / "llama3")
    hf = load_hf(path).to(DEVICE)
    engine = Engine(EngineConfig(model_dir=str(path), device=DEVICE, kernel_backend="triton", num_slots=512,
                                 dtype="float32", max_requests=4, max_prefill_tokens=32, context_attention=(32, 16)))
    context = engine.worker.context_attention
    if DEVICE == "cuda":
        assert context is None
        return
    attended = []
    attend = context.attend
    context.attend = lambda rows, *a: attended.append([(r.q_len, r.keys) for r in rows]) or attend(rows, *a)
    prompt = torch.randint(3, 384, (88,), generator=torch.Generator().manual_seed(7)).tolist()
    out = engine.generate([GenerationRequest(0, prompt, 4, SamplingParams(prompt_logprobs=True),
                                             stop_token_ids=[])])[0]
    layers = engine.worker.model_config.num_layers
    assert attended == [[(32, 32)]] * layers + [[(16, 64)]] * layers      # the last chunk's first piece
    tokens, _ = hf_reference(hf, prompt, 4)
    assert [o.token_id for o in out] == tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out[0].prompt_logprobs[1:] == pytest.approx([ref[p, prompt[p + 1]].item() for p in range(87)], abs=1e-3)
    assert engine.kv_usage()[0] == 0
