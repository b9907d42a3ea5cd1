"""uvicorn's HTTP/1.1 protocol with a deadline for each request head.

uvicorn closes an idle keep-alive connection after a few seconds, but a client that sends
part of a request line or of its headers and then nothing (slowloris) holds its connection
forever. ``HeaderTimeoutProtocol`` closes a connection whose request head is not complete
``HEADER_TIMEOUT_S`` after the connection opened or the previous response ended.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0     # a request head takes milliseconds; ten seconds is generous for slow links


class HeaderTimeoutProtocol(H11Protocol):
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:     # the head arrived (a request is under way)
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._on_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_timeout(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
