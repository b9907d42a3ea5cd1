"""engine.processes: the server's processes are forked by a fork server that preloaded torch, in
the environment of the moment each one is started."""
import os

from engine.processes import PRELOAD, process_context, start_process
from tests.unit._child_report import report


def test_a_child_has_torch_imported_and_the_environment_of_its_start(monkeypatch):
    ours, theirs = process_context().Pipe(duplex=True)
    first = start_process(report, (theirs, "ENGINE_TEST_VALUE"), "first")
    value, torch_loaded, parent = ours.recv()
    first.join(30)
    assert "torch" in PRELOAD and torch_loaded          # forked with torch already imported
    assert parent != os.getpid()                        # by the fork server, not by this process
    assert value == os.environ.get("ENGINE_TEST_VALUE")
    # set after the fork server started: a forked child still sees it
    monkeypatch.setenv("ENGINE_TEST_VALUE", "set later")
    ours, theirs = process_context().Pipe(duplex=True)
    second = start_process(report, (theirs, "ENGINE_TEST_VALUE"), "second")
    assert ours.recv()[0] == "set later"
    second.join(30)
    assert first.exitcode == second.exitcode == 0
