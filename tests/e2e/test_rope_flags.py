"""--rope-scaling / --rope-factor through the launched server: a prompt longer than the
checkpoint's context gets the greedy tokens transformers computes with that rope_scaling."""
import json
from pathlib import Path

import pytest
import requests
import torch
import transformers

from tests.e2e.server import running
from tests.tiny_models import save_tiny_server_model

ORIGINAL_CONTEXT = 64
PROMPT = "the quick brown fox jumps over the lazy dog. hello world, hello there! " * 5
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    """A tiny Llama whose config.json says 64 positions (the prompt below is longer)."""
    model_dir = save_tiny_server_model("llama", tmp_path_factory.mktemp("rope") / "tiny-llama")
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["max_position_embeddings"] = ORIGINAL_CONTEXT
    path.write_text(json.dumps(config))
    return model_dir


def with_rope_scaling(model_dir: Path, kind: str, factor: float) -> Path:
    """The checkpoint beside itself with `rope_scaling` in its config.json (transformers 4 and 5 both
    read it there; 5 keeps rope parameters elsewhere on the config object)."""
    scaled = model_dir.parent / f"{model_dir.name}-{kind}-{factor}"
    scaled.mkdir(exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "config.json" and not (scaled / item.name).exists():
            (scaled / item.name).symlink_to(item)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": kind, "type": kind, "factor": factor}
    (scaled / "config.json").write_text(json.dumps(config))
    return scaled


def transformers_greedy(model_dir, kind: str, factor: float, prompt_ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(with_rope_scaling(Path(model_dir), kind, factor),
                                                              torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_rope_flags_serve_what_transformers_computes(short_context_model, kind):
    prompt_ids = transformers.AutoTokenizer.from_pretrained(short_context_model)(PROMPT).input_ids
    assert ORIGINAL_CONTEXT < len(prompt_ids) < 2 * ORIGINAL_CONTEXT - NEW_TOKENS
    with running(short_context_model, "--rope-scaling", kind, "--rope-factor", "2") as srv:
        info = requests.get(srv.url + "/info", timeout=5).json()
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        answer = requests.post(srv.url + "/generate", json=body, timeout=60)
    assert info["max_total_tokens"] == 2 * ORIGINAL_CONTEXT            # the context grew by the factor
    assert answer.status_code == 200, answer.text
    details = answer.json()["details"]
    assert details["prefill"] == [] or len(details["prefill"]) == len(prompt_ids)
    served = [token["id"] for token in details["tokens"]]
    assert served == transformers_greedy(short_context_model, kind, 2.0, prompt_ids)
