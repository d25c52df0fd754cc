# Record: how docs/bench/footprint_start_2026-12-07 was made (see README.md there): python eight_streams.py URL PID
"""8 concurrent streams of ~2k-token prompts against a server; samples its RSS; prints the peak."""
import concurrent.futures, glob, json, os, sys, threading, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
files = [f for f in files if os.path.getsize(f) > 12000][:8]
peak = [0]; done = threading.Event()
def rss():
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) * 1024
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()
def one(path):
    text = open(path).read()[:7000]
    body = json.dumps({"prompt": text + "\n# Summary of the module above:\n", "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    t = time.time(); out = json.load(urllib.request.urlopen(req, timeout=3600))
    return out["usage"]["prompt_tokens"], time.time() - t
print("idle RSS", rss() / 2**30, "GiB", flush=True)
with concurrent.futures.ThreadPoolExecutor(8) as ex:
    for tokens, secs in ex.map(one, files):
        print(f"prompt {tokens} tokens answered in {secs:.1f} s", flush=True)
done.set()
time.sleep(1.5)
print(f"peak RSS {peak[0] / 2**30:.2f} GiB; after {rss() / 2**30:.2f} GiB", flush=True)
