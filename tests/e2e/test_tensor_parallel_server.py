"""`launcher.py --num-shard 2` on the CPU (gloo): the HTTP answers equal one shard's."""
import pytest
import requests
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams
from tests.e2e.server import LaunchedServer, free_port
from tests.tiny_models import save_tiny_server_model

PROMPTS = ["hello world", "the quick brown fox jumps", "0123"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """One KV head (replicated on both shards) and q/k/v biases."""
    return save_tiny_server_model("qwen2", tmp_path_factory.mktemp("tp") / "qwen2")


def test_two_shard_server_answers_like_one_shard(qwen2_dir):
    """Tokens, and the prompt's logprobs (``decoder_input_details``), whose logits both shards form 2 positions
    at a time (``--max-batch-size 2``: the warm-up's rows) and gather."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen2_dir)
    engine = Engine(EngineConfig(model_dir=str(qwen2_dir), device="cpu", kernel_backend="torch", num_slots=1024))
    expected = engine.generate([GenerationRequest(i, tokenizer(p)["input_ids"], 12, SamplingParams(prompt_logprobs=True),
                                                  stop_token_ids=[]) for i, p in enumerate(PROMPTS)])
    srv = LaunchedServer(qwen2_dir, "--num-shard", "2", "--master-port", str(free_port()),
                         "--max-total-tokens", "256", "--max-input-tokens", "128", "--max-batch-size", "2")
    try:
        srv.wait_healthy()
        info = requests.get(srv.url + "/info", timeout=5).json()
        assert "\ntgi_num_shards 2.0\n" in requests.get(srv.url + "/metrics", timeout=5).text
        for i, prompt in enumerate(PROMPTS):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True,
                                                     "decoder_input_details": True}}
            details = requests.post(srv.url + "/generate", json=body, timeout=60).json()["details"]
            ours = [e.token_id for e in expected[i]]
            got = [t["id"] for t in details["tokens"]]
            assert got == ours[: len(got)] and (len(got) == 12 or details["finish_reason"] == "eos_token")
            prompt_logprobs = expected[i][0].prompt_logprobs
            assert len(details["prefill"]) == len(prompt_logprobs) > 2 and details["prefill"][0]["logprob"] is None
            assert [t["logprob"] for t in details["prefill"][1:]] == pytest.approx(prompt_logprobs[1:], abs=1e-4)
        assert info["max_total_tokens"] == 256
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize("args,message", [
    (["--num-shard", "3"], "does not divide over --num-shard 3"),
    (["--num-shard", "2", "--master-addr", "no-such-host.invalid"], "--master-addr 'no-such-host.invalid' cannot be resolved"),
    (["--num-shard", "2", "--sharded", "false"], "--sharded false contradicts --num-shard 2"),
])
def test_bad_shard_settings_are_one_line_startup_errors(qwen2_dir, args, message):
    srv = LaunchedServer(qwen2_dir, *args)
    code = srv.process.wait(60)
    output = srv.output()
    srv.stop()
    assert code != 0 and message in output and "Traceback" not in output
