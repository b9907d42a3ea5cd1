"""``--help`` of every script we ship besides the launcher (whose flags ``tests/unit/test_launch_config.py``
covers): the benchmark scripts and the demo model's and random checkpoints' scripts. Each flag says what it does
(a flag shown bare tells nothing of its unit, its default or the workload that reads it), and the help renders."""
import argparse
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = sorted(f"bench.{path.stem}" for path in (ROOT / "bench").glob("*.py") if "ArgumentParser(" in path.read_text())
WEIGHTS = ["weights.demo.train", "weights.demo.train_medusa", "weights.demo.evaluate", "weights.random_checkpoint"]


def test_the_benchmark_scripts_are_found():
    """The glob finds the scripts: an empty list would leave the test below nothing to check."""
    assert {"bench.serving_bench", "bench.kv_quant_bench", "bench.prefix_bench"} <= set(BENCH)


@pytest.mark.parametrize("module_name", BENCH + WEIGHTS)
def test_every_flag_of_the_scripts_says_what_it_does_in_help(module_name):
    """Each script builds its parser in ``build_parser()``; importing it needs no GPU."""
    module = importlib.import_module(module_name)
    assert hasattr(module, "build_parser"), f"{module_name}: put its parser in a build_parser()"
    parser = module.build_parser()
    bare = [action.dest for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert bare == [], f"{module_name}: arguments without help: {bare}"
    parser.format_help()        # a bad %(default)s or a bare % raises only when printed
