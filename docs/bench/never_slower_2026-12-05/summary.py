import json, sys
runs = sys.argv[1:]
methods = ["draft_model", "ngram", "eagle", "medusa", "lookahead", "rest", "suffix"]
cats = ["multi_turn", "code", "summarisation", "qa", "math", "all"]
print("| run | " + " | ".join(methods) + " |")
print("|---|" + "---:|" * len(methods))
for path in runs:
    r = json.load(open(path + "/results.json"))["per_request"]["T=0"]
    cells = []
    for m in methods:
        e, p = r["all"][m], r["all"]["plain"]
        cpu = e["tokens_per_cpu_s"] / p["tokens_per_cpu_s"]
        worst = min(r[c][m]["vs_plain"] for c in cats[:-1])
        cells.append(f"{e['vs_plain']:.2f} / {cpu:.2f} / {worst:.2f}")
    print(f"| {path.split('/')[-1]} | " + " | ".join(cells) + " |")
