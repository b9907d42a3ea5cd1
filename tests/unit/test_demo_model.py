"""The bundled demo model (weights/demo): loads everywhere, matches transformers, writes Python."""
import ast
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch", num_slots=8192,
                               max_requests=16, max_prefill_tokens=2048))


def test_the_folder_is_complete_and_small():
    names = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "heldout.txt", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file()) <= 40 * 2**20
    assert (DEMO / "heldout.txt").stat().st_size <= 200 * 1024
    config = json.loads((DEMO / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]     # grouped-query attention
    tok_config = json.loads((DEMO / "tokenizer_config.json").read_text())
    assert tok_config.get("chat_template") and tok_config.get("eos_token") and tok_config.get("bos_token")


def test_greedy_tokens_equal_transformers(engine, tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO, torch_dtype=torch.float32).eval()
    prompts = ["def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range("]
    requests = [GenerationRequest(i, tokenizer(p)["input_ids"], 24, stop_token_ids=[]) for i, p in enumerate(prompts)]
    ours = engine.generate(requests)
    for i, r in enumerate(requests):
        out = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert [e.token_id for e in ours[i]] == out[0, len(r.prompt_ids):].tolist(), prompts[i]


def recorded_heldout_loss() -> float:
    return recorded_heldout_loss_of(DEMO)


def recorded_heldout_loss_of(folder: Path) -> float:
    card = (folder / "README.md").read_text()
    return float(re.search(r"held-out loss[^0-9]*([0-9]+\.[0-9]+)", card, re.I).group(1))


def test_heldout_loss_computed_by_our_engine_is_what_the_card_says(engine, tokenizer):
    """Mean next-token cross-entropy over 512-token windows of heldout.txt, from prompt logprobs."""
    ids = tokenizer((DEMO / "heldout.txt").read_text())["input_ids"]
    windows = [ids[i : i + 512] for i in range(0, len(ids), 512) if len(ids[i : i + 512]) >= 2]
    requests = [GenerationRequest(i, w, 1, SamplingParams(prompt_logprobs=True)) for i, w in enumerate(windows)]
    out = engine.generate(requests)
    logprobs = [lp for i in range(len(windows)) for lp in out[i][0].prompt_logprobs[1:]]
    loss = -sum(logprobs) / len(logprobs)
    assert loss < recorded_heldout_loss() + 0.05, loss


def test_a_greedy_completion_of_def_is_the_start_of_a_python_function(engine, tokenizer):
    prompt = "def "
    out = engine.generate([GenerationRequest(0, tokenizer(prompt)["input_ids"], 96, stop_token_ids=[])])[0]
    text = prompt + tokenizer.decode([e.token_id for e in out], skip_special_tokens=True)
    head = text.split("\n\n")[0]
    lines = head.splitlines()
    assert re.match(r"def [A-Za-z_][A-Za-z_0-9]*\(", lines[0]), text
    # the signature and the body up to the first blank line compile once the last line is closed off
    candidates = ["\n".join(lines[:k]) + "\n    pass\n" for k in range(len(lines), 0, -1)]
    assert any(_compiles(c) for c in candidates), text


def _compiles(source: str) -> bool:
    try:
        ast.parse(source)
        return True
    except SyntaxError:
        return False


def small_stdlib(folder: Path, train_bytes: int = 1_000_000) -> Path:
    """The standard library's top-level modules as a corpus for `train.py --stdlib`: every held-out and
    validation file among them (the script's own split), and training files up to ``train_bytes``."""
    import shutil
    import sysconfig

    from weights.demo.train import split_of

    folder.mkdir()
    stdlib, kept = Path(sysconfig.get_paths()["stdlib"]), 0
    for path in sorted(stdlib.glob("*.py")):
        if split_of(path.name) == "train":
            if kept >= train_bytes:
                continue
            kept += path.stat().st_size
        shutil.copy(path, folder / path.name)
    return folder


def test_a_corpus_that_leaves_a_split_empty_is_refused_with_what_to_do(tmp_path):
    """``--stdlib`` of train.py and train_medusa.py: a missing directory, or one whose files leave a split empty, is
    a CorpusError that says so (the scripts print it and exit 1), not a traceback from deep in training."""
    from weights.demo.train import CorpusError, load_corpus

    with pytest.raises(CorpusError, match="is not a directory"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("x = 1\n")
    with pytest.raises(CorpusError, match="falls in the"):
        load_corpus(str(tmp_path / "one"))


def test_the_medusa_script_refuses_a_bad_corpus_before_it_loads_the_model(tmp_path):
    """``train_medusa.py --stdlib`` missing: one line and exit 1, before the model loads (a missing model
    directory, loaded first, would fail with a traceback of its own)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(DEMO / "train_medusa.py"), "--model", str(tmp_path / "no-model"),
                          "--stdlib", str(tmp_path / "no-stdlib"), "--out", str(tmp_path / "heads")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("error: ") and "is not a directory" in run.stderr


def test_the_training_script_smoke_run_writes_a_servable_checkpoint(tmp_path):
    """`train.py --smoke` (tiny model, 20 steps on the CPU): the whole pipeline from corpus to card, on a corpus of
    about 1.7 MB of the standard library (every split present) instead of all of it: the tokenizer's training and
    the encoding, not the pipeline, are what the whole library makes slow."""
    import subprocess
    import sys

    out = tmp_path / "smoke"
    run = subprocess.run([sys.executable, str(DEMO / "train.py"), "--smoke", "--device", "cpu", "--out", str(out),
                          "--stdlib", str(small_stdlib(tmp_path / "stdlib"))],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads((out / "training_log.json").read_text())
    assert record["training"]["steps"] == 20 and record["model"]["kv_heads"] < record["model"]["heads"]
    assert all(record["corpus"]["files"][split] > 0 for split in ("train", "val", "heldout")), record["corpus"]
    assert record["corpus"]["root"] == str(tmp_path / "stdlib")             # not "the standard library"
    assert f"files under `{tmp_path / 'stdlib'}`" in (out / "README.md").read_text()
    assert abs(recorded_heldout_loss_of(out) - record["heldout"]["loss"]) < 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    engine = Engine(EngineConfig(model_dir=str(out), device="cpu", kernel_backend="torch", num_slots=512))
    events = engine.generate([GenerationRequest(0, tokenizer("def ")["input_ids"], 8, stop_token_ids=[])])[0]
    assert len(events) == 8 and engine.kv_usage()[0] == 0


def test_the_medusa_training_script_smoke_run_writes_heads_the_engine_loads(tmp_path):
    """`train_medusa.py` on a few windows and steps: heads in TGI's layout, with a config naming the demo model
    relative to themselves, that the engine plans with and that draft (the bundled heads came from a full run); on
    the small corpus of the smoke run above (``--stdlib``), not the whole standard library."""
    import subprocess
    import sys

    from engine.assembly import plan_engine

    out = tmp_path / "medusa"
    run = subprocess.run([sys.executable, str(DEMO / "train_medusa.py"), "--out", str(out), "--windows", "2",
                          "--heldout-windows", "1", "--steps", "3", "--batch", "16", "--heads", "2", "--layers", "2",
                          "--stdlib", str(small_stdlib(tmp_path / "stdlib"))],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 2
    assert (out / config["base_model_name_or_path"]).resolve() == DEMO.resolve()
    record = json.loads((out / "training_log.json").read_text())
    assert record["run"]["steps"] == 3 and len(record["heldout_after"]["head_accuracy"]) == 2
    assert record["args"]["stdlib"] == str(tmp_path / "stdlib")
    plan = plan_engine(EngineConfig(model_dir=str(DEMO), device="cpu", speculate=2, draft_heads=str(out)))
    assert plan.scheduler.draft_heads and plan.worker.draft_heads == str(out)
