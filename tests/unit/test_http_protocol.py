"""The front end's HTTP protocol closes a connection whose request head never completes."""
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tgi_compat import http_protocol


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(http_protocol, "HEADER_TIMEOUT_S", 0.5)
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", http=http_protocol.HeaderTimeoutProtocol, lifespan="off")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    instance.should_exit = True
    thread.join(5)


def closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        return conn.recv(1024) == b""
    except socket.timeout:
        return False


def test_a_request_head_that_never_completes_is_closed(server):
    with socket.create_connection(("127.0.0.1", server)) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")          # no blank line: the head never ends
        assert closed_within(conn, 3.0)


def response(conn: socket.socket) -> bytes:
    """One whole response of the test app (headers, then the body "ok")."""
    conn.settimeout(5.0)
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = conn.recv(1024)
        assert chunk, data
        data += chunk
    return data


def test_complete_requests_are_answered_on_a_kept_alive_connection(server):
    with socket.create_connection(("127.0.0.1", server)) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in response(conn)
        time.sleep(0.2)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")       # a second request on the same connection
        assert b"200 OK" in response(conn)
