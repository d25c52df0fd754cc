# Record: how docs/bench/long_e2e_2026-12-07 was made (see README.md there).
"""Long requests end to end through `specdecode serve` (default flags): a chat with a pasted file, a completion with
`suffix` (fill in the middle through the OpenAI API) and an /infill with several input_extra files, each about
TOKENS tokens of stdlib text (different files, so no prefix is shared); prints each request's prompt tokens, time to
first token (streamed), decode rate after it and the first words of the answer; one more request over the context
checks the 400 and that it costs nothing.

    python docs/bench/long_e2e_2026-12-07/long_e2e.py URL [--tokens 16000]
"""
import argparse, glob, json, os, time, urllib.error, urllib.request

STDLIB = os.path.dirname(os.__file__)
CHARS_PER_TOKEN = 3.6  # stdlib Python under Qwen2.5's tokenizer, measured


def text_of(names, tokens):
    out = ""
    for name in names:
        out += f"# file: {name}\n" + open(os.path.join(STDLIB, name)).read()
        if len(out) > tokens * CHARS_PER_TOKEN:
            break
    return out[:int(tokens * CHARS_PER_TOKEN)]


def stream(url, path, body):
    req = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                 {"content-type": "application/json"})
    start, first, pieces, usage = time.time(), None, [], None
    with urllib.request.urlopen(req, timeout=7200) as reply:
        for line in reply:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            text = (event.get("content") if "content" in event else
                    "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in event.get("choices", [])))
            if text and first is None:
                first = time.time() - start
            pieces.append(text or "")
            usage = event.get("usage") or usage
            if "tokens_evaluated" in event:
                usage = {"prompt_tokens": event["tokens_evaluated"], "completion_tokens": event.get("tokens_predicted")}
    total = time.time() - start
    return first, total, "".join(pieces), usage


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--tokens", type=int, default=16000)
    args = parser.parse_args()
    n = args.tokens
    cases = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text_of(
            ["argparse.py", "typing.py"], n) + "\n\nWhat does the first class in this file do? One sentence."}],
            "max_tokens": 48, "temperature": 0, "stream_options": {"include_usage": True}}),
        "suffix": ("/v1/completions", {"prompt": text_of(["tarfile.py", "zipfile.py"], n - 400),
                                       "suffix": "\n\ndef _unused_helper():\n    pass\n", "max_tokens": 48,
                                       "temperature": 0, "stream_options": {"include_usage": True}}),
        "infill": ("/infill", {"input_extra": [{"filename": name, "text": text_of([name], n // 4)}
                                               for name in ("inspect.py", "pathlib.py", "subprocess.py")],
                               "input_prefix": text_of(["shutil.py"], n // 8), "input_suffix": "\n",
                               "prompt": "    ", "n_predict": 48, "temperature": 0}),
    }
    for name, (path, body) in cases.items():
        first, total, text, usage = stream(args.url, path, body)
        print(json.dumps({"case": name, "usage": usage, "ttft_s": round(first or total, 1),
                          "decode_tok_s": round(((usage or {}).get("completion_tokens") or 0) / max(1e-9, total - (first or total)), 1),
                          "answer": text[:80]}), flush=True)
    over = {"messages": [{"role": "user", "content": text_of(["typing.py", "inspect.py", "tarfile.py", "zipfile.py",
                                                            "argparse.py", "subprocess.py"], 36000)}], "max_tokens": 8}
    start = time.time()
    try:
        urllib.request.urlopen(urllib.request.Request(args.url + "/v1/chat/completions", json.dumps(over).encode(),
                                                      {"content-type": "application/json"}), timeout=600)
        print("over the context: answered 200 (unexpected)")
    except urllib.error.HTTPError as error:
        print(json.dumps({"case": "over the context", "status": error.code, "seconds": round(time.time() - start, 2),
                          "error": json.loads(error.read())["error"]["message"][:160]}), flush=True)


if __name__ == "__main__":
    main()
