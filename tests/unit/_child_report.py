"""A child process's report for tests/unit/test_processes.py (torch-free, so its import in the
child cannot be what brought torch in)."""
import os
import sys


def report(conn, name: str) -> None:
    conn.send((os.environ.get(name), "torch" in sys.modules, os.getppid()))
    conn.close()
