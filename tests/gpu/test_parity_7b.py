"""A random Llama-2-7B-shaped bf16 checkpoint: greedy tokens equal transformers' for 64 tokens."""
import gc

import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.sampling import SamplingParams

NEW_TOKENS = 64
PROMPT_LENGTHS = [7, 64, 129, 300]


def test_greedy_tokens_equal_transformers_on_llama2_7b(llama2_7b_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama2_7b_dir, torch_dtype=torch.bfloat16,
                                                            device_map="cuda", attn_implementation="sdpa")
    expected, expected_logprobs = [], []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected.append(out.sequences[0, len(prompt):].tolist())
        expected_logprobs.append([torch.log_softmax(s[0].float(), -1).cpu() for s in out.logits])
    del hf
    gc.collect()
    torch.cuda.empty_cache()

    engine = Engine(EngineConfig(model_dir=llama2_7b_dir, num_slots=8192, max_requests=8))
    requests = [GenerationRequest(i, p, NEW_TOKENS, SamplingParams(), stop_token_ids=[]) for i, p in enumerate(prompts)]
    got = engine.generate(requests)
    del engine
    eager = Engine(EngineConfig(model_dir=llama2_7b_dir, num_slots=8192, max_requests=8, cuda_graphs=()))
    eager_tokens = {i: [e.token_id for e in events] for i, events in eager.generate(requests).items()}
    assert eager_tokens == {i: [e.token_id for e in events] for i, events in got.items()}, "graphs != eager"
    del eager
    report = []
    for i in range(len(prompts)):
        tokens = [e.token_id for e in got[i]]
        first_diff = next((k for k, (a, b) in enumerate(zip(tokens, expected[i])) if a != b), None)
        if first_diff is not None:
            ref = expected_logprobs[i][first_diff]
            report.append(f"prompt {i}: first difference at token {first_diff}: ours {tokens[first_diff]} "
                          f"(hf logprob {ref[tokens[first_diff]]:.4f}) vs hf {expected[i][first_diff]} "
                          f"(hf logprob {ref[expected[i][first_diff]]:.4f})")
        for e, ref in zip(got[i][: first_diff or NEW_TOKENS], expected_logprobs[i]):
            assert abs(e.logprob - ref[e.token_id].item()) < 0.1
    print("\n".join(report) or "all 4 x 64 greedy tokens identical")
    assert not report, "\n".join(report)
