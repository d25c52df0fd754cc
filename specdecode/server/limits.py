"""What one client may ask of the server: request sizes, stop strings, chat length, connection timeouts.

Every bound is checked before any work is done on the request (and before the engine sees it), and answered
with a 4xx in OpenAI's error format that names the limit and the flag that raises it.
"""
from __future__ import annotations

import dataclasses

from specdecode.errors import ConfigError


@dataclasses.dataclass
class ServerLimits:
    """Bounds on requests and connections (`specdecode serve` has a flag for each)."""

    max_body_bytes: int = 1 << 20
    """Largest request body in bytes (413 beyond); --max-body-bytes."""
    max_messages: int = 1024
    """Most messages in one chat request; --max-messages."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (default and upper bound: the model's context minus one); --max-prompt-tokens."""
    max_stop_strings: int = 16
    """Most stop strings in one request (each is scanned at every step); --max-stop-strings."""
    max_stop_chars: int = 256
    """Longest stop string, in characters; --max-stop-chars."""
    body_timeout: float = 30.0
    """Seconds a client may take to send its request body (408 beyond); --body-timeout."""
    header_timeout: float = 10.0
    """Seconds a client may take to send a request's headers before the connection is closed; --header-timeout."""
    keep_alive_timeout: int = 5
    """Seconds an idle keep-alive connection stays open; --keep-alive-timeout."""
    max_header_bytes: int = 16 * 1024
    """Largest request head (request line and headers) in bytes; --max-header-bytes."""
    max_connections: int | None = None
    """Connections and requests in progress at once before new ones get 503 (None: no limit); --max-connections."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                flag = "--" + f.name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number, got {value!r}")

    def prompt_tokens(self, context: int) -> int:
        """Longest prompt allowed with a model of this context length."""
        return min(self.max_prompt_tokens or context - 1, context - 1)

    def check_request(self, req, vocab_size: int) -> None:
        """Bounds on the fields every request has (stop strings, top_k)."""
        from specdecode.server.protocol import bad_request  # (the CLI reads the limits without the server's models)

        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.max_stop_strings:
            raise bad_request(f"at most {self.max_stop_strings} stop strings are allowed, got {len(stop)} "
                              "(the server's --max-stop-strings)", "stop")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_chars:
            raise bad_request(f"stop strings may have at most {self.max_stop_chars} characters, got one of {longest} "
                              "(the server's --max-stop-chars)", "stop")
        if req.top_k is not None and req.top_k > vocab_size:
            raise bad_request(f"top_k must be at most the vocabulary size {vocab_size} (0 or -1 keeps every token), "
                              f"got {req.top_k}", "top_k")

    def check_messages(self, messages: list) -> None:
        from specdecode.server.protocol import bad_request

        if len(messages) > self.max_messages:
            raise bad_request(f"at most {self.max_messages} messages are allowed in one request, got "
                              f"{len(messages)} (the server's --max-messages)", "messages")


def too_large(limit: int):
    """The 413 APIError of a body over `limit` bytes."""
    from specdecode.server.protocol import APIError

    return APIError(413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)",
                    code="request_too_large")
