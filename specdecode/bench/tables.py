"""Markdown tables of per-method decoding figures, shared by the held-out benchmarks."""
from __future__ import annotations


def method_table(rows: dict[str, dict], speedup_header: str = "speedup") -> str:
    """rows: method -> {tokens_per_s, speedup, tokens_per_target_pass, acceptance_rate, same_tokens_as_plain}."""
    lines = [f"| method | tokens/s | {speedup_header} | tokens per target pass | acceptance | same tokens as plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tokens_per_target_pass']:.2f} | "
                     f"{acc} | {r['same_tokens_as_plain']} |")
    return "\n".join(lines)
