"""--json-output: one shared formatter; every line a process writes is one valid JSON object."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

from engine.processes import JsonFormatter

REPO = Path(__file__).resolve().parents[2]


def test_the_formatter_escapes_quotes_newlines_and_control_characters():
    record = logging.LogRecord("engine.router", logging.WARNING, __file__, 1, 'a "quoted" %s\nnext\tline \x01',
                               ("value",), None)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["fields"]["message"] == 'a "quoted" value\nnext\tline \x01'
    assert (parsed["level"], parsed["target"], parsed["process"]) == ("WARNING", "engine.router", "launcher")
    assert parsed["timestamp"].endswith("Z")


def test_the_formatter_keeps_the_traceback_in_a_field():
    try:
        raise RuntimeError('bad "thing"')
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    parsed = json.loads(JsonFormatter().format(record))
    assert 'RuntimeError: bad "thing"' in parsed["fields"]["exception"]


SCRIPT = textwrap.dedent('''
    import logging, sys, warnings
    from engine.processes import LogSetup
    LogSetup("INFO", json_lines=True).apply()
    logging.getLogger("uvicorn.error").warning('say "hi"\\nagain')
    print("a plain print")
    sys.stderr.write("\\rLoading weights: 0%|\\rLoading weights: 100%|\\n")
    warnings.warn("a warning")
    logging.getLogger("debugged").debug("below the level: not written")
    sys.stdout.write("no newline at the end")
    __import__("json").loads("{")                    # an uncaught traceback
''')


def test_every_line_of_a_json_process_parses(tmp_path):
    """Log records, prints, progress bars, warnings and an uncaught traceback: all JSON lines."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).splitlines()
    records = [json.loads(line) for line in lines]          # raises on any line that is not JSON
    messages = [r["fields"]["message"] for r in records]
    assert 'say "hi"\nagain' in messages and "a plain print" in messages
    assert "Loading weights: 100%|" in messages and "no newline at the end" in messages
    assert any("a warning" in m for m in messages)
    assert any("JSONDecodeError" in m for m in messages)
    assert not any("below the level" in m for m in messages)
    assert {r["target"] for r in records} >= {"uvicorn.error", "stdout", "stderr", "py.warnings"}

