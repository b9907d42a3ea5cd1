"""bench.serving_bench's server handling."""
import argparse
from types import SimpleNamespace

from bench.serving_bench import stop_server


def test_the_server_log_is_kept_in_a_folder_that_did_not_exist(tmp_path):
    """A missing ``--server-log-dir`` is created at the end (it raised there before, losing the run's results)."""
    log = tmp_path / "server.log"
    log.write_text("served\n")
    server = SimpleNamespace(stop=lambda: 0, log_path=str(log), port=4242)
    folder = tmp_path / "logs" / "run1"
    stop_server(server, argparse.Namespace(server_log_dir=str(folder)))
    assert (folder / "server-4242.log").read_text() == "served\n"
