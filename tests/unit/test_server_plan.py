"""What the launcher's config becomes before any process starts: the shard's dtype, the kernel
backend, the tokenizer config, and the CPU thread count a shard takes."""
import json
import os

import pytest
import torch

from tgi_compat.launch_config import parse_args
from engine.worker.process import _limit_cpu_threads
from tgi_compat.launch_plan import plan_server
from tests.tiny_models import save_tiny_server_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_server_model("llama", tmp_path_factory.mktemp("plan") / "tiny-llama")


@pytest.mark.parametrize("flag,expected", [([], torch.float32), (["--dtype", "float32"], torch.float32),
                                           (["--dtype", "bfloat16"], torch.bfloat16),
                                           (["--dtype", "float16"], torch.float16)])
def test_dtype_reaches_the_shard_and_info(model_dir, flag, expected):
    plan = plan_server(parse_args(["--model-id", str(model_dir), *flag], environ={"HF_HUB_OFFLINE": "1"}))
    assert plan.engine.worker.dtype == expected
    assert plan.frontend.settings.model_dtype == str(expected).removeprefix("torch.")


def test_disable_custom_kernels_runs_the_torch_references(model_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")        # where the Triton kernels would run otherwise
    argv = ["--model-id", str(model_dir)]
    assert plan_server(parse_args(argv, environ={})).engine.worker.kernel_backend == "triton"
    plan = plan_server(parse_args([*argv, "--disable-custom-kernels"], environ={}))
    assert plan.engine.worker.kernel_backend == "torch"


def test_tokenizer_config_path_reaches_the_front_end_and_its_template_is_used(model_dir, tmp_path):
    from tgi_compat.chat_template import ChatTemplate
    from tgi_compat.frontend_process import load_tokenizer
    from tgi_compat.openai_schema import ChatMessage

    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}",
                                "eos_token": "</s>"}))
    plan = plan_server(parse_args(["--model-id", str(model_dir), "--tokenizer-config-path", str(path)], environ={}))
    assert plan.frontend.tokenizer_config_path == str(path)
    tokenizer = load_tokenizer(plan.frontend.model_dir, plan.frontend.tokenizer_config_path)
    rendered = ChatTemplate(tokenizer).render((ChatMessage("user", "hi"),))
    assert rendered == "<<hi>>"


@pytest.mark.parametrize("content", ["not json", "[1, 2]"])
def test_a_bad_tokenizer_config_path_stops_the_launcher(model_dir, tmp_path, content):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--tokenizer-config-path"):
        plan_server(parse_args(["--model-id", str(model_dir), "--tokenizer-config-path", str(path)], environ={}))
    with pytest.raises(ValueError, match="cannot be read"):
        plan_server(parse_args(["--model-id", str(model_dir), "--tokenizer-config-path", str(tmp_path / "no")],
                               environ={}))


@pytest.mark.parametrize("argv,environ,expected", [([], {}, True), (["--prefix-caching", "false"], {}, False),
                                                   ([], {"PREFIX_CACHING": "0"}, False)])
def test_prefix_caching_switch_reaches_the_scheduler(model_dir, argv, environ, expected):
    plan = plan_server(parse_args(["--model-id", str(model_dir), *argv], environ=environ))
    assert plan.engine.scheduler.prefix_caching is expected


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_shards_leave_a_core_to_the_router_and_front_end(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    _limit_cpu_threads(world_size=1)
    assert torch.get_num_threads() == 8
    _limit_cpu_threads(world_size=2)
    assert torch.get_num_threads() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    _limit_cpu_threads(world_size=2)
    assert torch.get_num_threads() == 1


def test_omp_num_threads_is_the_users_choice(monkeypatch, restore_threads):
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    _limit_cpu_threads(world_size=1)
    assert torch.get_num_threads() == 3


def test_a_model_without_a_tokenizer_is_refused_before_any_process_starts(model_dir, tmp_path):
    """No tokenizer file at all: the launcher's plan refuses it. Files that do not make a fast tokenizer
    (a sentencepiece model only, and sentencepiece is not installed): the front end's clear error."""
    import shutil

    from tgi_compat.frontend_process import TokenizerError, load_tokenizer

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no tokenizer .*copy tokenizer.json"):
        plan_server(parse_args(["--model-id", str(bare)], environ={}))
    (bare / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    (bare / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerError, match="cannot be loaded .*add the base model's tokenizer.json"):
        load_tokenizer(str(bare))
