"""The live dashboard: GET /dashboard is a page (plain HTML and a small script, no build step, nothing fetched from
elsewhere) that polls GET /dashboard/data a few times a second and draws the engine's counters as rates over a
rolling window. The data are the very numbers /metrics shows, as JSON; rates are computed in the page.
"""
from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from specdecode.engine.async_engine import AsyncEngine

POLL_SECONDS = 0.25
"""How often the page asks for new data (it reads this from the data, so the two never disagree)."""
WINDOW_SECONDS = 120
"""How much history the page keeps and draws."""
RATE_SECONDS = 2.0
"""Span over which the page turns counters into rates (shorter is noisier)."""

# The page loads only its own script and talks only to this server.
_CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def install(app: FastAPI, engine: AsyncEngine, model_name: str) -> None:
    """Add the dashboard's routes (the engine's metrics already read its KV cache use: AsyncEngine.__init__)."""
    llm = engine.llm
    method = llm.spec_config.method if llm.proposer is not None else None
    static = resources.files("specdecode.server") / "static"
    page = (static / "dashboard.html").read_text(encoding="utf-8")
    script = (static / "dashboard.js").read_text(encoding="utf-8")
    headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
    info = {"model": model_name, "method": method or "off", "max_num_seqs": llm.max_num_seqs,
            "max_model_len": llm.max_model_len, "poll_seconds": POLL_SECONDS, "window_seconds": WINDOW_SECONDS,
            "rate_seconds": RATE_SECONDS}

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard():
        return HTMLResponse(page, headers=headers)

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script():
        return Response(script, media_type="text/javascript", headers=headers)

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data():
        """Wall-clock time (seconds), what this server runs, and every sample of /metrics but histogram buckets."""
        return {"time": time.time(), **info, "samples": engine.metrics.samples()}
