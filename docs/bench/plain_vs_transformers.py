# Record: how the 2026-11-29 figures against transformers in docs/bench/history_readme_2026-12-04.md were made: python docs/bench/plain_vs_transformers.py --threads 1
"""Plain (non-speculative) decoding speed: specdecode's LLM.generate against transformers' generate().

Both decode the same greedy continuation of the same prompt from the same checkpoint (a random ~30M-parameter Llama,
or --model), in one process, so machine load affects both alike; transformers in float32, specdecode in --dtype.
Goal: specdecode >= 1.3x transformers (the speed issue's: float32 >= 1.6x, bfloat16 >= 2.5x; docs/bench/speed.py).

    python docs/bench/plain_vs_transformers.py [--model DIR] [--dtype float32] [--tokens 128] [--repeats 9] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from specdecode.engine.llm import LLM
from specdecode.model.config import ModelConfig
from specdecode.model.linear import linear_backend
from specdecode.model.llama import LlamaForCausalLM
from specdecode.model.loading import save_model
from specdecode.sampling import SamplingParams
from specdecode.train.tokenizer import copy_tokenizer, save_tokenizer, train_bpe

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def tokenizer_dir(workdir: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on a few standard-library files (the 2026-11-29 run used the 8,192-token tokenizer
    of the pair then shipped in specdecode/catalog/)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:60]]
    out = workdir / "tokenizer"
    save_tokenizer(train_bpe(texts, vocab_size), out, model_max_length=2048)
    return out


def build_checkpoint(workdir: Path, vocab_size: int) -> Path:
    """A random Llama of ~30M parameters (hidden 512, 8 layers, 8 heads, MLP 1408), saved as a HF directory."""
    tok_dir = tokenizer_dir(workdir, vocab_size)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    out = workdir / "model"
    save_model(model, out, dtype=torch.float32)
    copy_tokenizer(tok_dir, out)
    (out / "generation_config.json").unlink()  # no EOS: both libraries decode exactly --tokens tokens
    print(f"checkpoint: {config.num_parameters() / 1e6:.1f}M parameters, vocab {vocab}", file=sys.stderr)
    return out


def time_interleaved(fns: dict, repeats: int) -> dict[str, tuple[list[float], list[int]]]:
    """Seconds of `repeats` calls of each function, one call of each per round (so that a change in the
    machine's load hits all alike), after one warm-up call each; also the token ids each returned."""
    ids = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            ids[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (times[name], ids[name]) for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens to generate per run (default 128)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per library (default 9)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained tokenizer")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: a random one)")
    parser.add_argument("--dtype", default="float32", help="specdecode's dtype (default float32)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_checkpoint(Path(tmp), args.vocab_size)
        llm = LLM(model=model_dir, dtype=args.dtype, device="cpu")
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        prompt_ids = llm.tokenizer.encode(PROMPT)

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_input = torch.tensor([prompt_ids])

        def run_specdecode() -> list[int]:
            return llm.generate([prompt_ids], params)[0].outputs[0].token_ids

        def run_transformers() -> list[int]:
            with torch.no_grad():
                out = hf.generate(hf_input, attention_mask=torch.ones_like(hf_input), do_sample=False,
                                  max_new_tokens=args.tokens, min_new_tokens=args.tokens, pad_token_id=0)
            return out[0, len(prompt_ids):].tolist()

        results = time_interleaved({"specdecode": run_specdecode, "transformers": run_transformers}, args.repeats)
        (ours_s, ours_ids), (hf_s, hf_ids) = results["specdecode"], results["transformers"]

    ours_tps, hf_tps = args.tokens / statistics.median(ours_s), args.tokens / statistics.median(hf_s)
    ours_best, hf_best = args.tokens / min(ours_s), args.tokens / min(hf_s)
    print(f"prompt {len(prompt_ids)} tokens, {args.tokens} new tokens, batch 1, specdecode {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.repeats} interleaved runs each     median    (best)")
    print(f"transformers float32; specdecode {llm.target.dtype}, linear backend {linear_backend(llm.target)}")
    print(f"specdecode   {ours_tps:8.1f} tokens/s  ({ours_best:6.1f})")
    print(f"transformers {hf_tps:8.1f} tokens/s  ({hf_best:6.1f})  transformers {transformers.__version__}")
    print(f"ratio        {ours_tps / hf_tps:8.2f}x          ({ours_best / hf_best:5.2f}x)  goal >= 1.3x")
    print(f"same tokens: {ours_ids == hf_ids}")

if __name__ == "__main__":
    main()
