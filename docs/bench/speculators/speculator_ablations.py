# Record: how ablations.json, ablations.md and ablations.png here were made: python docs/bench/speculators/speculator_ablations.py --add "NAME=runs/HEAD" --table docs/bench/speculators/ablations.json
"""The speculator-training ablations in one table and one plot: held-out top-1 / top-5 per depth (or head) of each
trained head, read from the training.json its run wrote.

    python docs/bench/speculators/speculator_ablations.py --add "8k vocabulary=runs/eagle-v8k-head" \
        --table docs/bench/speculators/ablations.json

`--add NAME=DIR` records (or replaces) that head's figures in the table file; the table file then renders as
ablations.md and ablations.png beside it. Entries keep the command that trained them and the held-out data they
were measured on, so a figure is only compared with figures on the same held-out text.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def entry(name: str, folder: Path) -> dict:
    info = json.loads((folder / "training.json").read_text())
    acc = info["heldout_topk_accuracy"]
    ranks = acc["ranks"]
    held = info.get("heldout_data") or {}
    return {"name": name, "kind": info["kind"], "command": info["command"],
            "draft_vocab_size": info["draft_vocab_size"], "feature_layers": info.get("feature_layers"),
            "steps": info["train"]["step"], "tokens_seen": info["train"]["tokens_seen"],
            "minutes": round(info["train"]["wall_time_s"] / 60, 1),
            "heldout": held.get("corpus") or held.get("file") or "ShareGPT held-out split",
            "heldout_answer_tokens": held.get("answer_tokens"),
            "top1": [row[ranks.index(1)] for row in acc["per_depth"]],
            "top5": [row[ranks.index(5)] for row in acc["per_depth"]]}


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def table_lines(table: dict) -> list[str]:
    lines = [table.get("intro", ""), "",
             "| head | held-out | steps | tokens seen | minutes | top-1 per depth | top-5 per depth |",
             "|---|---|---|---|---|---|---|"]
    for r in table["entries"]:
        lines.append(f"| {r['name']} | {r['heldout']} | {r['steps']} | {_count(r['tokens_seen'])} | {r['minutes']} | "
                     + " / ".join(f"{a:.1%}" for a in r["top1"]) + " | "
                     + " / ".join(f"{a:.1%}" for a in r["top5"]) + " |")
    return lines + ["", "Commands:", ""] + [f"- {r['name']}: `{r['command']}`" for r in table["entries"]] + [""]


def write_card_section(table: dict, card: Path) -> None:
    """Put the table into a speculator's card as its "## Ablations" section (replacing an older one)."""
    text = card.read_text()
    head, _, rest = text.partition("\n## Ablations\n")
    tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
    card.write_text(head.rstrip("\n") + "\n\n## Ablations\n\n" + "\n".join(table_lines(table)) + tail)


def render(table: dict, folder: Path, stem: str) -> None:
    rows = table["entries"]
    lines = [f"# {table.get('title', 'Speculator ablations')}", ""] + table_lines(table)
    (folder / f"{stem}.md").write_text("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = max(len(r["top1"]) for r in rows)
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(rows):
        xs = [d + i * width for d in range(len(r["top1"]))]
        ax.bar(xs, [100 * a for a in r["top1"]], width, label=r["name"])
    ax.set_xticks([d + 0.4 - width / 2 for d in range(depths)], [f"depth {d + 1}" for d in range(depths)])
    ax.set_ylabel("held-out top-1 (%)")
    ax.set_title(table.get("title", "Speculator ablations"))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(folder / f"{stem}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, required=True, help="the table file (JSON), created when missing")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=DIR",
                        help="record the head trained into DIR (its training.json) under NAME")
    parser.add_argument("--card", type=Path, action="append", default=[],
                        help="a speculator's README.md that gets the table as its Ablations section")
    args = parser.parse_args()
    table = json.loads(args.table.read_text()) if args.table.is_file() else {"entries": []}
    for item in args.add:
        name, _, folder = item.partition("=")
        new = entry(name, Path(folder))
        table["entries"] = [e for e in table["entries"] if e["name"] != name] + [new]
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(json.dumps(table, indent=1) + "\n")
    render(table, args.table.parent, args.table.stem)
    for card in args.card:
        write_card_section(table, card)


if __name__ == "__main__":
    main()
