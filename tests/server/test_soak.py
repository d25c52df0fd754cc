"""A short soak (specdecode bench soak) against `specdecode serve` in a child process on the tiny model, speculating:
16 clients, streaming and not, greedy and sampled, completions and chat, some walking away mid-stream or cancelling;
a KV pool too small for everyone, so requests wait for blocks and are preempted and recomputed; no 5xx, every
completed greedy answer equals offline generation, the gauges (KV blocks used too) return to 0 and the server's memory
stays within 10% of what it was after warm-up. (The full run: 64 clients for 10 minutes on SmolLM2.)"""
import httpx
import pytest

from specdecode.engine.llm import LLM

from specdecode.bench.soak import SoakConfig, check_greedy, offline_generator, run_soak
from specdecode.bench.servers import start_server, stop_server


@pytest.mark.slow
def test_short_soak(tiny_models):
    spec = ["--speculative-model", str(tiny_models["draft"]), "--num-speculative-tokens", "3", "--no-adaptive"]
    # a pool of 1.5 sequences of max_model_len for 8 running: admission waits and preemption storms under load
    proc, url = start_server(["--model", str(tiny_models["target"]), "--dtype", "float32", "--max-num-seqs", "8",
                              "--max-model-len", "256", "--num-kv-blocks", "24", *spec], timeout=300)
    try:
        report = run_soak(url, proc.pid, SoakConfig(clients=16, duration=20, warmup=15, seed=0))
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        stop_server(proc)
    llm = LLM(tiny_models["target"], dtype="float32", max_model_len=256)
    check_greedy(report, offline_generator(llm))
    assert report.ok, report.summary() + "\n" + "\n".join(report.mismatches[:5] + report.transport_errors[:5])
    assert report.completed >= 20 and report.abandoned >= 2 and report.greedy_checked >= 3, report.summary()
    assert report.gauges_end.get("specdecode:kv_cache_blocks_used") == 0, report.gauges_end  # no block leaked
    preemptions = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("specdecode:num_preemptions_total")]
    assert preemptions and preemptions[0] > 0, "the small pool must have preempted under this load"
