"""bench long's timing, table and plot, on a fake engine and a fake clock (the real runs are in docs/bench)."""
from __future__ import annotations

from specdecode.bench import long


class FakeLLM:
    """Yields one piece per step; the clock advances 2 s for the prefill and 0.5 s per later token."""

    def __init__(self, clock):
        self.clock = clock

    def stream(self, ids, params):
        self.clock.now += 2.0
        yield "a"
        for _ in range(params.max_tokens - 1):
            self.clock.now += 0.5
            yield "b"


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_time_ours_reads_prefill_from_the_first_token_and_decode_after_it():
    clock = Clock()
    timed = long.time_ours(FakeLLM(clock), list(range(100)), 9, now=clock)
    assert timed["ttft_s"] == 2.0 and timed["prefill_tokens_per_s"] == 50.0
    assert timed["decode_tokens_per_s"] == 2.0  # 8 tokens in 4 s


def test_the_table_gives_ratios_to_the_first_row_and_to_llama_cpp(tmp_path):
    rows = [{"length": n, "ours": {"prompt_tokens": n, "ttft_s": n / p, "prefill_tokens_per_s": p,
                                   "decode_tokens_per_s": d},
             "llama.cpp": {"prompt_tokens": n, "ttft_s": n / (p / 2), "prefill_tokens_per_s": p / 2,
                           "decode_tokens_per_s": d / 4}}
            for n, p, d in [(512, 80.0, 12.0), (4096, 64.0, 6.0)]]
    results = {"model": "/x/model.gguf", "threads": 1, "tokens": 32, "cpu": "a CPU", "kv_cache_dtype": "float16",
               "rows": rows}
    table = long.markdown(results)
    last = table.strip().splitlines()[-1]
    assert "4,096" in last and "0.80x" in last and "0.50x" in last  # prefill and decode against the first row
    assert last.count("2.00x") == 1 and last.count("4.00x") == 1  # against llama.cpp
    long.plot(results, tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 1000


def test_the_source_text_is_long_enough_and_the_same_each_time():
    text = long.source_text(200_000)
    assert len(text) >= 200_000 and text == long.source_text(200_000)
    assert "def " in text and "import " in text  # Python source, as code assistants send
