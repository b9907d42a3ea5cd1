"""``--help`` of every benchmark script: each flag says what it does (a flag shown bare tells nothing of its
unit, its default or the workload that reads it), and the help renders."""
import argparse
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py") if "ArgumentParser(" in path.read_text())


def test_the_benchmark_scripts_are_found():
    """The glob finds the scripts: an empty list would leave the test below nothing to check."""
    assert {"serving_bench", "kv_quant_bench", "prefix_bench"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_the_benchmark_scripts_says_what_it_does_in_help(script):
    """Each script builds its parser in ``build_parser()``; importing it needs no GPU."""
    module = importlib.import_module(f"bench.{script}")
    assert hasattr(module, "build_parser"), f"bench/{script}.py: put its parser in a build_parser()"
    parser = module.build_parser()
    bare = [action.dest for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert bare == [], f"bench/{script}.py: arguments without help: {bare}"
    parser.format_help()        # a bad %(default)s or a bare % raises only when printed
