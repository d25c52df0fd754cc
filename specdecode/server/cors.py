"""Cross-origin requests from web pages, as llama-server's --cors-origins allows them, but off unless asked for: a page
in a browser must not drive a server on the user's machine (llama-server's default, '*', lets any page do so).

A preflight (OPTIONS) is answered here, 200 and empty, with the CORS headers when the page's origin is allowed and
without them otherwise (the browser then refuses the request); other answers get Access-Control-Allow-Origin when the
origin is allowed.
"""
from __future__ import annotations

from urllib.parse import urlsplit

LOCAL_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "::1")
METHODS = "GET, POST, DELETE, OPTIONS"
"""llama-server's default --cors-methods."""


def origin_is_local(origin: str) -> bool:
    """http(s)://localhost, 127.0.0.1 or [::1], any port (not 'localhost.evil.com')."""
    try:
        parts = urlsplit(origin)
        parts.port  # raises on a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.hostname in LOCAL_ORIGIN_HOSTS


class CorsPolicy:
    """Which page origins may call the server: None (no page), '*' (any: its Origin is reflected, with credentials,
    as llama-server does), 'localhost' (pages served from this machine) or a comma-separated list of origins."""

    def __init__(self, origins: str | None):
        self.origins = origins.strip() if origins else None
        self.listed = {o.strip().rstrip("/") for o in (self.origins or "").split(",") if o.strip()}

    def allowed(self, origin: str) -> bool:
        if not origin or not self.origins:
            return False
        if self.origins == "*":
            return True
        if self.origins == "localhost":
            return origin_is_local(origin)
        return origin.rstrip("/") in self.listed


class Cors:
    """ASGI middleware applying a CorsPolicy (outermost, so that a preflight needs no key, as browsers send none)."""

    def __init__(self, app, policy: CorsPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), "")
        allowed = self.policy.allowed(origin)
        if scope["method"] == "OPTIONS":
            headers = [(b"content-type", b"text/html"), (b"content-length", b"0")]
            if allowed:
                headers += [*self.allow(origin), (b"Access-Control-Allow-Methods", METHODS.encode()),
                            (b"Access-Control-Allow-Headers", b"*")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not allowed:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.allow(origin)]}
            await send(message)
        await self.app(scope, receive, send_with_cors)

    @staticmethod
    def allow(origin: str) -> list[tuple[bytes, bytes]]:
        """The headers that let the page read the answer, cased as llama-server writes them (HTTP does not care;
        clients that copy headers into a plain dict do)."""
        return [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                (b"Access-Control-Allow-Credentials", b"true"), (b"Vary", b"Origin")]
