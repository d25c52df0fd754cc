"""`specdecode serve` on the default model, watched the way a user would: /dashboard in a real headless Chromium
while clients send traffic (the page must show live, non-zero figures and draw every chart), and a real Prometheus
scraping /metrics every second (what it scraped must equal what /metrics says, the tokens it counted must be the
tokens the clients received, and every panel of docs/grafana/specdecode.json must answer).

Each test skips when its program is not installed, unless SPECDECODE_REQUIRE_BROWSER / SPECDECODE_REQUIRE_PROMETHEUS
is set (CI sets both: .ci/run installs Debian's chromium and prometheus). SPECDECODE_DASHBOARD_PNG=PATH also saves the
browser's screenshot there (how docs/dashboard.png is made).
"""
import base64
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from specdecode.bench.servers import free_port, start_server, stop_server, terminate

from .test_dashboard import exposition

DOCS = Path(__file__).resolve().parents[2] / "docs"
SLOTS = 4
DRAFT_TOKENS = 3
TEXTS = ["The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
         "Roses are red, violets are blue, sugar is sweet, and so are you.",
         "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday."]
"""Prompts the model answers by copying, so prompt lookup (the default method) has drafts to accept."""


def program(names: tuple[str, ...], require: str) -> str:
    """The path of the first of names installed; skips without one, unless the variable `require` is set."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    if os.environ.get(require):
        pytest.fail(f"{require} is set but none of {', '.join(names)} is installed")
    pytest.skip(f"{names[0]} is not installed (apt-get install {names[0]}; {require}=1 makes this a failure)")


# (Module fixtures, named before `served`: a missing program skips before the server starts.)
@pytest.fixture(scope="module")
def chromium() -> str:
    return program(("chromium", "chromium-browser", "google-chrome"), "SPECDECODE_REQUIRE_BROWSER")


@pytest.fixture(scope="module")
def prometheus_program() -> str:
    return program(("prometheus",), "SPECDECODE_REQUIRE_PROMETHEUS")


@pytest.fixture(scope="module")
def served(smollm2):
    """`specdecode serve` on SmolLM2 with its default method (prompt lookup), sized small, and
    drafting a fixed 3 tokens: on a busy machine the adaptive controller may draft nothing, leaving nothing to check."""
    proc, url = start_server(["--model", "smollm2-135m-instruct", "--max-num-seqs", str(SLOTS), "--max-model-len", "1024", "--num-speculative-tokens",
                              str(DRAFT_TOKENS), "--no-adaptive"], timeout=300)
    try:
        yield SimpleNamespace(url=url, port=int(url.rsplit(":", 1)[1]))
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_dashboard_shows_live_figures_in_chromium(chromium, served, tmp_path):
    keep = os.environ.get("SPECDECODE_DASHBOARD_PNG")
    # For the documentation's picture: a minute of traffic, with more clients than slots so some queue.
    window, polls, clients = (60, 240, SLOTS + 2) if keep else (20, 16, SLOTS)
    with Traffic(served.url, clients=clients) as traffic:
        traffic.wait_for_tokens(20)
        with Browser(chromium, tmp_path / "profile", width=1400, height=900) as browser:
            browser.open(f"{served.url}/dashboard?window={window}")
            page = browser.wait_for(PAGE_STATE, lambda s: s["polls"] >= polls and s["tokensPerSecond"] > 0,
                                    timeout=polls / 4 + 30)
            png = browser.screenshot()
    (tmp_path / "dashboard.png").write_bytes(png)
    if keep:
        Path(keep).write_bytes(png)
    assert page["error"] is None and traffic.errors == []
    assert page["polls"] >= polls and page["tokensPerSecond"] > 0
    tiles = page["tiles"]
    assert float(tiles["tile-tokens"]) > 0 and float(tiles["tile-batch"]) >= 1
    assert re.fullmatch(r"\d+\.\d\d×", tiles["tile-speedup"]) and re.fullmatch(r"\d+%", tiles["tile-acceptance"])
    assert re.fullmatch(r"\d+\.\d%", tiles["tile-kv"]) and float(tiles["tile-kv"][:-1]) > 0
    assert "smollm2-135m-instruct" in page["model"] and "ngram" in page["model"]
    undrawn = [name for name, pixels in page["drawn"].items() if pixels < 40]
    assert undrawn == [], f"these charts drew no data: {undrawn}"
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1400


@pytest.mark.slow
def test_prometheus_scrapes_what_the_engine_counted(prometheus_program, served, tmp_path):
    with Prometheus(prometheus_program, served.port, tmp_path) as prometheus:
        before = settled(served, prometheus)
        with Traffic(served.url) as traffic:
            traffic.wait_for_tokens(120)
            time.sleep(3)  # three scrapes under load: a rate needs two samples (120 tokens can take under a second)
            busy = time.time()  # every client is still generating
        after = settled(served, prometheus)
        assert traffic.errors == [] and traffic.requests >= SLOTS

        # The last scrape (after the traffic) saw exactly what /metrics says now: every counter, gauge, sum, count.
        assert prometheus.samples(after.time) == after.metrics

        # Counted while the clients waited: the tokens they received, the acceptance at each draft position and
        # the realised speedup between the two idle moments, from Prometheus alone.
        span = f"{int((after.time - before.time) * 1000)}ms"  # (back to a moment after `before`, still idle)

        def moved(name: str) -> str:
            return f"(specdecode:{name} - specdecode:{name} offset {span})"

        def delta(key: str) -> float:
            return after.metrics[f"specdecode:{key}"] - before.metrics.get(f"specdecode:{key}", 0)

        tokens = prometheus.query(moved("generation_tokens_total"), after.time)
        assert value(tokens) == traffic.completion_tokens == delta("generation_tokens_total")
        per_position = prometheus.query(f'{moved("spec_decode_num_accepted_tokens_per_pos_total")} / '
                                        f'{moved("spec_decode_num_drafts_per_pos_total")}', after.time)
        seen = {r["metric"]["position"]: float(r["value"][1]) for r in per_position if r["value"][1] != "NaN"}
        expected = {}
        for pos in re.findall(r'drafts_per_pos_total\{position="(\d+)"\}', " ".join(after.metrics)):
            drafted = delta(f'spec_decode_num_drafts_per_pos_total{{position="{pos}"}}')
            if drafted:  # (Prometheus: 0 / 0 = NaN)
                expected[pos] = delta(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}') / drafted
        assert seen == expected and sorted(seen) == [str(i) for i in range(DRAFT_TOKENS)]
        speedup = prometheus.query(f'{moved("spec_decode_plain_equivalent_seconds_total")} / '
                                   f'{moved("spec_decode_actual_seconds_total")}', after.time)
        assert value(speedup) == delta("spec_decode_plain_equivalent_seconds_total") / delta(
            "spec_decode_actual_seconds_total") > 0

        # Every panel of the Grafana dashboard (the PromQL of docs/metrics.md) answers, in range, mid-traffic.
        figures = panel_figures(prometheus, busy)
    assert figures["generated tokens/s"] > 0 and 0 < figures["realised speedup"] < 20
    assert 0 <= figures["draft acceptance"] <= 1 and figures["tokens per step"] >= 1
    assert 1 <= figures["batch size"] <= SLOTS and 0 < figures["KV cache use"] <= 100
    assert figures["Draft and verify time per step/verify"] > 0
    assert 0 <= figures["Acceptance by method (accepted / proposed draft tokens)/ngram"] <= 1
    positions = {k: v for k, v in figures.items() if k.startswith("Acceptance per draft position/")}
    drafted = {k: v for k, v in positions.items() if v == v}  # (NaN: no draft reached it, here past DRAFT_TOKENS)
    assert len(drafted) == DRAFT_TOKENS and all(0 <= v <= 1 for v in drafted.values()), positions


# -- Prometheus ------------------------------------------------------------------------------------------------

class Prometheus:
    """A Prometheus server in a folder of its own, scraping one target every second."""

    def __init__(self, binary: str, target_port: int, folder: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # (JSON is YAML)
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "specdecode",
                                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}]}))
        self.log = folder / "prometheus.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'tsdb'}",
                                             f"--web.listen-address={self.url.split('//')[1]}"],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> "Prometheus":
        deadline = time.monotonic() + 30
        while not self._answers("/-/ready"):
            assert self.process.poll() is None, "prometheus exited:\n" + self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus was not ready within 30 s"
            time.sleep(0.2)
        while not self.query('up{job="specdecode"} == 1'):
            assert time.monotonic() < deadline, "prometheus did not scrape the server within 30 s"
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        terminate(self.process)

    def _answers(self, path: str) -> bool:
        try:
            return httpx.get(self.url + path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query through /api/v1/query (at: evaluation time, seconds since the epoch)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = httpx.get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10).json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def samples(self, at: float) -> dict[str, float]:
        """Every specdecode series at `at`, keyed as exposition() keys /metrics (without the job's labels)."""
        values = {}
        for r in self.query('{__name__=~"specdecode:.+", __name__!~".+_(bucket|created)"}', at):
            labels = {k: v for k, v in r["metric"].items() if k not in ("__name__", "instance", "job")}
            text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            values[r["metric"]["__name__"] + (f"{{{text}}}" if text else "")] = float(r["value"][1])
        return values


def value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def settled(served, prometheus: Prometheus, timeout: float = 60) -> SimpleNamespace:
    """Once nothing runs: /metrics, and a time at which Prometheus' latest scrape was taken after it was read."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = exposition(served.url)
        if metrics["specdecode:num_requests_running"] == metrics["specdecode:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.2)
    read = time.time()
    while True:
        now = time.time()
        scraped = prometheus.query("timestamp(specdecode:generation_tokens_total)", now)
        if scraped and float(scraped[0]["value"][1]) > read:
            return SimpleNamespace(time=now, metrics=metrics)
        assert time.monotonic() < deadline, "prometheus did not scrape the idle server"
        time.sleep(0.2)


def panel_figures(prometheus: Prometheus, at: float) -> dict[str, float]:
    """Each target of the Grafana dashboard at `at`: 'title' or 'title/legend' (one per series) -> value. Every query
    must be one docs/metrics.md documents and must answer with data."""
    dashboard = json.loads((DOCS / "grafana" / "specdecode.json").read_text())
    documented = (DOCS / "metrics.md").read_text()
    figures = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            assert f"`{expr.replace('$__rate_interval', '1m')}`" in documented, f"not in docs/metrics.md: {expr}"
            result = prometheus.query(expr.replace("$__rate_interval", "10s"), at)
            assert result, f"{panel['title']}: {expr} found no data"
            for r in result:
                legend = re.sub(r"\{\{(\w+)\}\}", lambda m: r["metric"].get(m[1], ""), target["legendFormat"])
                figures[panel["title"] if panel["type"] == "stat" else f"{panel['title']}/{legend}"] = float(
                    r["value"][1])
    return figures


# -- traffic ---------------------------------------------------------------------------------------------------

class Traffic:
    """Clients asking for chat completions back to back until the block ends (then they finish the request in hand):
    counts the requests answered and the completion tokens they reported."""

    def __init__(self, url: str, clients: int = SLOTS, max_tokens: int = 32):
        self.url, self.max_tokens, self.clients = url, max_tokens, clients
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = self.completion_tokens = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = index
            while not self.stop.is_set():
                text = TEXTS[n % len(TEXTS)]
                body = {"messages": [{"role": "user", "content": f"Repeat this text exactly, three times:\n{text}"}],
                        "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    response = http.post(self.url + "/v1/chat/completions", json=body)
                    response.raise_for_status()
                    tokens = response.json()["usage"]["completion_tokens"]
                except Exception as exc:
                    with self.lock:
                        self.errors.append(repr(exc))
                    return
                with self.lock:
                    self.requests += 1
                    self.completion_tokens += tokens
                n += self.clients

    def wait_for_tokens(self, tokens: int, timeout: float = 60) -> None:
        """Until the server has generated that many tokens more than when the traffic began."""
        start = exposition(self.url)["specdecode:generation_tokens_total"]
        deadline = time.monotonic() + timeout
        while exposition(self.url)["specdecode:generation_tokens_total"] - start < tokens:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"the server did not generate {tokens} tokens in {timeout:g} s"
            time.sleep(0.25)

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


# -- Chromium --------------------------------------------------------------------------------------------------

PAGE_STATE = """(() => {
  const status = document.getElementById("status");
  if (!status) return null;  // (not loaded yet)
  const tiles = {};
  for (const el of document.querySelectorAll(".tile .value")) tiles[el.id] = el.textContent;
  // Pixels of a chart in a series' colour (saturated, unlike the grey grid and text), below the legend.
  const drawn = {};
  for (const canvas of document.querySelectorAll("canvas")) {
    const skip = Math.ceil(24 * (window.devicePixelRatio || 1));
    const data = canvas.getContext("2d").getImageData(0, skip, canvas.width, canvas.height - skip).data;
    let n = 0;
    for (let i = 0; i < data.length; i += 4) {
      if (data[i + 3] > 128 && Math.max(data[i], data[i + 1], data[i + 2]) - Math.min(data[i], data[i + 1], data[i + 2]) > 80) n++;
    }
    drawn[canvas.id] = n;
  }
  return {polls: Number(status.dataset.polls), tokensPerSecond: Number(status.dataset.tokensPerSecond || 0),
          error: status.dataset.error || null, model: document.getElementById("model").textContent, tiles, drawn};
})()"""
"""What the test reads of the page: the status element's data, the tiles' text and how much each chart drew."""


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: it reads commands on
    fd 3 and answers on fd 4, each message a JSON text ending in NUL). Unlike --screenshot with a virtual time budget,
    the page runs in real time, so its polls see the server change."""

    def __init__(self, binary: str, profile: Path, width: int, height: int):
        self.log = profile.with_name("chromium.log")
        commands, self._commands = os.pipe()
        self._answers, answers = os.pipe()
        # Its ends numbered 10 or more, so that making them its fds 3 and 4 cannot overwrite one with the other (bash,
        # not sh: dash takes one-digit fd numbers only).
        commands, answers = (_renumbered(fd) for fd in (commands, answers))
        argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--hide-scrollbars", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "about:blank"]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{commands} 4>&{answers}', "bash", *argv],
                                            pass_fds=(commands, answers), stdout=subprocess.DEVNULL, stderr=log,
                                            start_new_session=True)
        os.close(commands)
        os.close(answers)
        self.size = (width, height)
        self._buffer = b""
        self._ids = iter(range(1, 1 << 30))
        self.session = None

    def send(self, method: str, timeout: float = 30, **params) -> dict:
        """One command (to the page once open() attached to it); returns its result."""
        message = {"id": next(self._ids), "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                assert left > 0 and select.select([self._answers], [], [], left)[0], f"{method}: no answer"
                chunk = os.read(self._answers, 1 << 20)
                assert chunk, "chromium closed its pipe"
                self._buffer += chunk
            text, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(text)
            if answer.get("id") == message["id"]:  # (anything else is an event)
                assert "error" not in answer, f"{method}: {answer['error']}"
                return answer["result"]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        width, height = self.size
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, ready, timeout: float = 40):
        """Evaluate expression until ready(value); returns the last value (the test's asserts say what was wrong)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.evaluate(expression)
            if (state is not None and ready(state)) or time.monotonic() > deadline:
                return state
            time.sleep(0.5)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.session = None
            self.send("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:  # its helper processes, in the session it was started in
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(self._commands)
        os.close(self._answers)


def _renumbered(fd: int) -> int:
    """A copy of fd numbered 10 or more (fd itself closed)."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return copy
