"""uvicorn's connection handling, bounded: how many connections, how long an idle or half-sent one may stay open,
how large a request head may be.

uvicorn times out idle keep-alive connections but not a client that sends half a request head and then nothing
(slowloris), so the h11 protocol is wrapped to close a connection whose head does not arrive within
`header_timeout`. A half-sent body is timed out by the Guard middleware.
"""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

from specdecode.server.limits import ServerLimits


def protocol_with_header_timeout(header_timeout: float) -> type[H11Protocol]:
    class HeaderTimeoutH11Protocol(H11Protocol):
        """h11 that closes a connection when a request head takes longer than header_timeout seconds to arrive."""

        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection must not dawdle either

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


def uvicorn_options(limits: ServerLimits) -> dict:
    """Keyword arguments for uvicorn.run / uvicorn.Config that apply the connection limits."""
    return {"http": protocol_with_header_timeout(limits.header_timeout),
            "limit_concurrency": limits.max_connections,
            "timeout_keep_alive": limits.keep_alive_timeout,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
