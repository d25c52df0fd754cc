"""llama-server's /metrics names (llamacpp:*), written after ours from the same counters, for dashboards built on
llama-server's: what each of its counters counts, in the engine's terms.

prompt_seconds_total is the time from arrival to first token (queueing included: the engine does not time a prompt's
pass apart), tokens_predicted_seconds_total the time after it; n_tokens_max is not kept (llama.cpp's largest
n_tokens of a batch) and is left out.
"""
from __future__ import annotations

PREFIX = "specdecode:"

COUNTERS = {
    "prompt_tokens_total": "Number of prompt tokens processed.",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache.",
    "prompt_seconds_total": "Prompt process time (arrival to first token).",
    "tokens_predicted_total": "Number of generation tokens processed.",
    "tokens_predicted_seconds_total": "Predict process time.",
    "n_decode_total": "Total number of decode steps.",
    "spec_decode_num_draft_tokens_total": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens_total": "Draft tokens accepted.",
    "spec_decode_num_drafts_total": "Sequence-steps that verified a draft.",
}
GAUGES = {
    "prompt_tokens_seconds": "Average prompt throughput in tokens/s.",
    "predicted_tokens_seconds": "Average generation throughput in tokens/s.",
    "requests_processing": "Number of requests processing.",
    "requests_deferred": "Number of requests deferred.",
    "n_busy_slots_per_decode": "Average number of busy slots per decode step.",
}


def values(samples: dict[str, float]) -> dict[str, float]:
    """llamacpp:* name (without the prefix) -> value, from EngineMetrics.samples()."""
    def get(name: str) -> float:
        return samples.get(PREFIX + name, 0.0)

    prompt = get("prompt_tokens_total") - get("prefix_cache_hits_total")
    prompt_s = get("time_to_first_token_seconds_sum")
    predicted = get("generation_tokens_total")
    predicted_s = max(0.0, get("e2e_request_latency_seconds_sum") - prompt_s)
    steps = get("decode_batch_size_count")
    return {
        "prompt_tokens_total": prompt, "prompt_tokens_cached_total": get("prefix_cache_hits_total"),
        "prompt_seconds_total": prompt_s, "tokens_predicted_total": predicted,
        "tokens_predicted_seconds_total": predicted_s, "n_decode_total": steps,
        "spec_decode_num_draft_tokens_total": get("spec_decode_num_draft_tokens_total"),
        "spec_decode_num_accepted_tokens_total": get("spec_decode_num_accepted_tokens_total"),
        "spec_decode_num_drafts_total": get("spec_decode_num_drafts_total"),
        "prompt_tokens_seconds": prompt / prompt_s if prompt_s > 0 else 0.0,
        "predicted_tokens_seconds": predicted / predicted_s if predicted_s > 0 else 0.0,
        "requests_processing": get("num_requests_running"), "requests_deferred": get("num_requests_waiting"),
        "n_busy_slots_per_decode": get("decode_batch_size_sum") / steps if steps else 0.0,
    }


def render(samples: dict[str, float]) -> bytes:
    """The llamacpp:* families in Prometheus' text format."""
    found = values(samples)
    lines = []
    for kind, families in (("counter", COUNTERS), ("gauge", GAUGES)):
        for name, help_text in families.items():
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {found[name]:.17g}"]
    return ("\n".join(lines) + "\n").encode()
