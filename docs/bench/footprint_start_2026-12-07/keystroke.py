# Record: how docs/bench/footprint_start_2026-12-07 was made (see README.md there): python keystroke.py URL
"""llama.vscode's shape against /infill: 256 lines of prefix, 64 of suffix, 3 input_extra chunks; then the same
request with a few characters typed at the cursor. Prints both times to first token (streamed) and the ratio."""
import glob, json, os, sys, time, urllib.request
STDLIB = os.path.dirname(os.__file__)
url = sys.argv[1]
src = open(STDLIB + "/argparse.py").read().splitlines(True)
extras = []
for path in [STDLIB + "/shutil.py", STDLIB + "/textwrap.py",
             STDLIB + "/copy.py"]:
    extras.append({"filename": os.path.basename(path), "text": "".join(open(path).read().splitlines(True)[:64])})
cursor = 1000
prefix = "".join(src[cursor - 256:cursor])
suffix = "".join(src[cursor:cursor + 64])
def ttft(typed):
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extras, "prompt": typed, "n_predict": 16,
            "stream": True, "cache_prompt": True, "temperature": 0}
    req = urllib.request.Request(url + "/infill", json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.time(); first = None; n_prompt = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: ") and first is None:
                first = time.time() - t
            if line.startswith(b"data: "):
                ev = json.loads(line[6:])
                n_prompt = ev.get("tokens_evaluated", n_prompt) or (ev.get("timings") or {}).get("prompt_n", n_prompt)
    return first, n_prompt
a, na = ttft("    ")
b, nb = ttft("    if ")
print(f"first request: TTFT {a:.2f} s ({na} prompt tokens); next keystroke: TTFT {b:.2f} s; ratio {b / a:.2f}")
