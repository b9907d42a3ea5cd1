"""bench.schedule_replay: the scheduler replayed with a step-time model (CPU, no model)."""
import json

import pytest

from bench import schedule_replay
from bench.schedule_replay import (EAGER_STEP_S, PIECEWISE_STEP_S, ROW_S, Load, arrivals_from_log, replay,
                                   step_model)
from engine.protocol.messages import FED_BACK, StepRow


def test_a_lone_prompt_and_its_decode_steps_take_the_modelled_times():
    model, span, _ = step_model("llama-2-7b")
    assert model.tau == pytest.approx(2 * 6.476e9 / 560e12, rel=0.01)      # Llama-2-7B's layers: 6.48e9 weights
    assert model.weights_s == pytest.approx(2 * 6.738e9 / 3.0e12 + 0.2e-3, rel=0.01)
    prompt = list(range(100, 1100))
    result = replay(Load("llama-2-7b", 4000, 2048, [(0.0, prompt, 3)]), stall_free_tokens=None,
                    max_prefill_tokens=4096)
    prefill = max(model.weights_s + model.tau * 1000 * (1 + 500 / span), PIECEWISE_STEP_S)
    assert result["ttft_s"]["p50"] == pytest.approx(prefill)
    decode = [model.weights_s + ROW_S + model.kv_s_per_token * (position + 1) for position in (1000, 1001)]
    assert result["itl_s"]["p50"] == pytest.approx(sum(decode) / 2)    # two gaps: their mean is the median
    assert result["steps"] == 3 and result["seconds"] == pytest.approx(prefill + sum(decode))


def test_a_step_with_prompt_tokens_takes_at_least_its_launches():
    """Through the piecewise graphs (a tree with ``engine.worker.piecewise``) or eagerly (a tree without); a
    decode step replays its graph: no floor."""
    model, _, _ = step_model("llama-2-7b")
    chunk = StepRow(1, 0, 0, [5] * 16, list(range(16)), sample=True)
    decode = StepRow(2, 1, 10, [FED_BACK], [99], sample=True)
    assert model.step_s([chunk, decode], FED_BACK) == PIECEWISE_STEP_S
    assert model.step_s([chunk, decode], FED_BACK, piecewise=False) == EAGER_STEP_S
    assert model.step_s([decode], FED_BACK) == pytest.approx(model.weights_s + ROW_S + model.kv_s_per_token * 11)


def test_arrivals_come_from_the_validated_lines_of_the_burst():
    log = "\n".join([
        "2026-11-28 04:09:34,356 INFO tgi_compat: request 9 validated: 4096 input tokens, max_new_tokens=1, x",
        "2026-11-28 04:10:20,100 INFO tgi_compat: request 12 validated: 15835 input tokens, max_new_tokens=128, x",
        "2026-11-28 04:10:20,350 INFO tgi_compat: request 13 validated: 2663 input tokens, max_new_tokens=128, x",
        "2026-11-28 04:10:20,350 INFO engine.router.scheduler: request 12 admitted: 15835 prompt tokens",
        "2026-11-28 04:10:20,400 INFO tgi_compat: request 14 validated: 20 input tokens, max_new_tokens=128, x",
    ])
    arrivals = arrivals_from_log(log, range(2000, 16001), {128})
    assert arrivals == [(0.0, 15835, 128), (pytest.approx(0.25), 2663, 128)]
    with pytest.raises(ValueError, match="no 'request N validated"):
        arrivals_from_log(log, range(30_000, 40_000), {128})


def test_the_command_replays_a_load_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert schedule_replay.main(["--load", "shared", "--stall-free-tokens", "384", "--stall-free-row-tokens", "32",
                                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 256 and result["ttft_s"]["p50"] <= result["ttft_s"]["p99"]
    assert "shared (256 requests, stall_free_tokens 384 + 32 a row)" in capsys.readouterr().out
    assert schedule_replay.main(["--load", "beside"]) == 0
    by_request = capsys.readouterr().out.splitlines()[-1]
    assert by_request.startswith("TTFT by request (s): 0: ") and by_request.count(":") == 5


def test_another_trees_scheduler_replays_through_tree(tmp_path):
    """``--tree``: that checkout's scheduler and launcher defaults (here a copy whose default cap differs)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    root = Path(schedule_replay.__file__).resolve().parents[1]
    tree = tmp_path / "tree"
    for package in ("engine", "tgi_compat", "kernels", "weights"):
        shutil.copytree(root / package, tree / package, ignore=shutil.ignore_patterns("demo", "__pycache__"))
    config = tree / "tgi_compat" / "launch_config.py"
    text = config.read_text().replace("\nSTALL_FREE_TOKENS = ", "\nSTALL_FREE_TOKENS = 111  # ", 1)
    config.write_text(text.replace("\nSTALL_FREE_ROW_TOKENS = ", "\nSTALL_FREE_ROW_TOKENS = 5  # ", 1))
    run = subprocess.run([sys.executable, "-m", "bench.schedule_replay", "--load", "shared", "--tree", str(tree)],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "stall_free_tokens 111 + 5 a row)" in run.stdout


@pytest.mark.parametrize("args,message", [
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens: must be a whole number >= 1, got 0"),
    (["--stall-free-tokens", "-1"], "--stall-free-tokens: must be a whole number >= 1, got -1"),
    (["--tree", "/no/such/tree"], "--tree /no/such/tree: no engine/router/scheduler.py there"),
    (["--arrivals-log", "/no/such.log"], "--arrivals-log /no/such.log: no such file"),
    (["--spread", "-1"], "--spread: must be a number of seconds >= 0, got -1"),
    (["--spread", "inf"], "--spread: must be a number of seconds >= 0, got inf"),
    (["--spread", "1", "--arrivals-log", __file__], "--spread and --arrivals-log both set the arrival times"),
])
def test_bad_flags_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        schedule_replay.main(["--load", "shared", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_log_without_the_loads_requests_is_a_usage_error(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text("2026-11-28 04:09:34,356 INFO tgi_compat: request 9 validated: 5 input tokens, max_new_tokens=1\n")
    with pytest.raises(SystemExit) as exited:
        schedule_replay.main(["--load", "mixed", "--arrivals-log", str(log)])
    assert exited.value.code == 2 and "no 'request N validated" in capsys.readouterr().err


def test_a_budget_flag_is_applied(tmp_path):
    steps = {}
    for budget in ("512", "4096"):
        out = tmp_path / f"{budget}.json"
        schedule_replay.main(["--load", "shared", "--max-prefill-tokens", budget, "--json", str(out)])
        steps[budget] = json.loads(out.read_text())["steps"]
    assert steps["512"] > steps["4096"]         # a smaller budget plans the burst's prompts in more steps


def test_a_spread_burst_arrives_within_its_seconds_and_waits_less_at_the_median():
    burst = schedule_replay.builtin_load("load512")
    spread = schedule_replay.spread_arrivals(burst, 1.0)
    times = [t for t, _, _ in spread.requests]
    assert all(0 <= t < 1.0 for t in times) and len(set(times)) == len(times)
    assert [ids for _, ids, _ in spread.requests] == [ids for _, ids, _ in burst.requests]
    assert schedule_replay.spread_arrivals(burst, 1.0).requests == spread.requests     # seeded
    at_once, over_a_second = (schedule_replay.replay(load, 704, 4096) for load in (burst, spread))
    # all at 0 s the shortest prompts fill the first wave; arriving over a second, that wave is mostly the early ones
    assert over_a_second["ttft_s"]["p50"] > 2 * at_once["ttft_s"]["p50"]
