"""The adaptive sweep returns one row per mode and batch size, and a summary row with the goal checks."""
from specdecode.bench.sweep import adaptive_sweep, markdown_table


def test_sweep_rows_and_table(tiny_models):
    rows = adaptive_sweep(tiny_models["target"], tiny_models["draft"], batch_sizes=(1, 2), ks=(1, 2), max_tokens=4,
                          repeats=1, prompts=["def add(a, b):", "class Point:"], dtype="float32", device="cpu",
                          log=lambda line: None)
    modes = ["plain", "K=1", "K=2", "adaptive", "summary"]
    assert [(r["batch_size"], r["mode"]) for r in rows] == [(b, m) for b in (1, 2) for m in modes]
    for r in rows:
        if r["mode"] == "summary":
            assert r["best_fixed"] in ("K=1", "K=2") and isinstance(r["goal_met"], bool)
        else:
            assert r["tokens_per_s"] > 0
    assert all(r["mean_draft_len"] > 0 for r in rows if r["mode"] in ("K=1", "K=2"))  # fixed K really drafted
    assert all(r["mean_draft_len"] == 0 for r in rows if r["mode"] == "plain")
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith("| B | plain | K=1 | K=2 | adaptive")
