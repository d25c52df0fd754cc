"""Fuzz the HTTP API with schemathesis against the server's own OpenAPI schema (/openapi.json): requests that follow
the schema (positive) and requests that break it (negative), for every operation. Checks: no 5xx; every 4xx in
OpenAI's error format; every answer conforms to the schema's status codes, content types and bodies; the server
still answers a plain request afterwards.

    specdecode bench fuzz --requests 2000            # starts `specdecode serve` (SmolLM2), fuzzes it
    specdecode bench fuzz --url http://127.0.0.1:8000 --requests 500

tests/server/test_fuzz.py runs a bounded fuzz against the tiny test model with the same functions.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import time

import httpx

from specdecode.bench.servers import start_server, stop_server

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclasses.dataclass
class FuzzReport:
    """What a fuzz run sent and what came back."""

    requests: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)
    """One line per request whose answer broke a check (the first 50 kept)."""
    failed: int = 0

    def add(self, status: int, problems: list[str], label: str) -> None:
        self.requests += 1
        self.statuses[status] += 1
        if problems:
            self.failed += 1
            if len(self.failures) < 50:
                self.failures.append(f"{label} -> {status}: {'; '.join(problems)}")

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self) -> str:
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{self.requests} requests ({codes}); {self.server_errors} 5xx; {self.failed} failed checks"


def openai_error_problems(response) -> list[str]:
    """Problems with a 4xx/5xx body, which must be {"error": {"message", "type", "param", "code"}}."""
    try:
        body = response.json()
    except ValueError:
        return ["the error body is not JSON"]
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not ERROR_KEYS <= set(error):  # (llama-server's overflow adds n_ctx, ...)
        return [f"not OpenAI's error format: {str(body)[:200]}"]
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return [f"the error has no message or type: {error}"]
    return []


def generate_cases(url: str, examples: int, seed: int = 0) -> list:
    """`examples` cases per operation and generation mode, drawn by hypothesis from the server's schema (fixed seed:
    the same cases every run)."""
    import hypothesis
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    cases = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # nothing to break: the GET routes take no parameters
            n = examples if operation.method.upper() == "POST" else max(1, examples // 10)

            @hypothesis.settings(max_examples=n, deadline=None, database=None, derandomize=False,
                                 phases=[hypothesis.Phase.generate], suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.seed(seed)
            @hypothesis.given(operation.as_strategy(generation_mode=mode))
            def draw(case):
                cases.append((f"{mode.value} {operation.method.upper()} {operation.path}", case))

            draw()
    return cases


def check_case(case, url: str, timeout: float) -> tuple[int, list[str]]:
    """Send one case; (status, problems)."""
    from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

    try:
        response = case.call(base_url=url, timeout=timeout)
    except Exception as exc:  # a dropped connection or a timeout is a failure of the server too
        return 0, [f"no answer: {type(exc).__name__}: {exc}"[:300]]
    problems = []
    status = response.status_code
    if status >= 500:
        problems.append("server error")
    if status >= 400:
        problems += openai_error_problems(response)
    try:
        case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                 response_schema_conformance])
    except BaseExceptionGroup as exc:  # schemathesis' FailureGroup: one exception per failed check
        problems += [f"schema: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                     for e in exc.exceptions]
    return status, problems


def fuzz(url: str, examples: int, seed: int = 0, workers: int = 8, timeout: float = 120.0) -> FuzzReport:
    """Generate the cases, then send them from `workers` threads at once (the server batches them)."""
    report = FuzzReport()
    cases = generate_cases(url, examples, seed)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(check_case, case, url, timeout): label for label, case in cases}
        for future in concurrent.futures.as_completed(futures):
            status, problems = future.result()
            report.add(status, problems, futures[future])
    return report


def still_serves(url: str, prompt: str = "Hello", max_tokens: int = 8) -> dict:
    """A plain greedy completion after the fuzz (raises if the server does not answer it properly)."""
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120)
    response.raise_for_status()
    body = response.json()
    assert body["usage"]["completion_tokens"] == max_tokens, body
    return body


def cmd_fuzz(args) -> int:
    """`specdecode bench fuzz` (its flags: specdecode/cli/bench.py)."""
    proc = None
    url = args.url
    if url is None:
        server_args = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "8"]
        for flag in ("model", "speculative_model"):
            if getattr(args, flag):
                server_args += ["--" + flag.replace("_", "-"), getattr(args, flag)]
        proc, url = start_server(server_args, args.port)
    try:
        start = time.monotonic()
        report, seed = FuzzReport(), args.seed
        while report.requests < args.requests:  # fresh seeds until enough requests went out
            part = fuzz(url, examples=200, seed=seed, workers=args.workers)
            for status, n in part.statuses.items():
                report.statuses[status] += n
            report.requests += part.requests
            report.failed += part.failed
            report.failures += part.failures[:50 - len(report.failures)]
            seed += 1
            print(f"seed {seed - 1}: {part.summary()}", flush=True)
        still_serves(url)
        elapsed = time.monotonic() - start
        print(f"total: {report.summary()} in {elapsed:.0f} s; the server still serves")
        for line in report.failures[:20]:
            print("  " + line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"requests": report.requests, "statuses": dict(report.statuses),
                           "server_errors": report.server_errors, "failed": report.failed,
                           "failures": report.failures, "seconds": elapsed}, f, indent=1)
        return 1 if report.failed else 0
    finally:
        if proc is not None:
            stop_server(proc)

