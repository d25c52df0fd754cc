"""ASGI middleware in front of every route: the Host header must be one the server answers to (against DNS
rebinding), every route but the few in OPEN_PATHS needs the API key if one is set (in `Authorization: Bearer KEY` or
llama-server's `X-Api-Key: KEY`), and a POST body is no larger than the body limit and sent within the body
timeout. A body is read as JSON whatever its Content-Type says (a bare `curl -d` works, as with llama-server), except
from a web page of an origin the CORS policy does not allow: a page can send text/plain or a form to any site without
a preflight, but not application/json, so such a request must be JSON (and a JSON one needs the preflight, which is
refused). The body is read here, once, and handed to the route.
"""
from __future__ import annotations

import asyncio
import hmac

from starlette.responses import JSONResponse

from specdecode.server.cors import CorsPolicy
from specdecode.server.limits import ServerLimits, too_large
from specdecode.server.protocol import APIError

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

OPEN_PATHS = frozenset({"/health", "/v1/health", "/dashboard", "/dashboard/dashboard.js"})
"""What answers without the API key: liveness (as llama-server leaves /health and /v1/health open) and the
dashboard's page and script, which hold no data (the page asks /dashboard/data, guarded, with the key). Everything
else - generation, models, metrics, the dashboard's data, the OpenAPI schema, any route added later - needs it."""


def host_name(value: str) -> str:
    """The host part of a Host header: 'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    def __init__(self, app, limits: ServerLimits, allowed_hosts: list[str], api_key: str | None = None,
                 cors: CorsPolicy | None = None):
        """allowed_hosts: host names the Host header may carry ("*" allows any); cors: the page origins allowed."""
        self.app = app
        self.cors = cors or CorsPolicy(None)
        self.limits = limits
        self.any_host = "*" in allowed_hosts
        self.allowed_hosts = {host_name(h) for h in allowed_hosts}
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            headers = {name: value for name, value in scope["headers"]}
            self._check_host(headers.get(b"host", b"").decode("latin-1"))
            if scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":  # browsers send no key in a preflight
                self._check_key(headers)
            if scope["method"] == "POST":
                body = await self._read_body(headers, receive)
                if body is None:  # the client went away
                    return
                receive = _replay(body, receive)
        except APIError as error:
            headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
            response = JSONResponse(error.body(), status_code=error.status, headers=headers)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_host(self, host: str) -> None:
        if not self.any_host and host_name(host) not in self.allowed_hosts:
            raise APIError(400, f"the Host header {host!r} is not one this server answers to; start it with "
                                f"--allowed-hosts {host_name(host) or 'HOST'} (or '*') to allow it",
                           code="invalid_host")

    def _check_key(self, headers: dict) -> None:
        if self.api_key is None:
            return
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            token = headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(token.strip(), self.api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
                           type="authentication_error", code="invalid_api_key")

    async def _read_body(self, headers: dict, receive) -> bytes | None:
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        origin = headers.get(b"origin", b"").decode("latin-1")
        if media_type != b"application/json" and origin and not self.cors.allowed(origin):
            raise APIError(415, f"a request from the web page {origin!r} must send its body as JSON with "
                                "'Content-Type: application/json' (the server's --cors-origins does not allow that "
                                "origin)", code="unsupported_media_type")
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s "
                                    "(the server's --body-timeout)", code="request_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that first returns the whole body, then whatever the client sends next (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
