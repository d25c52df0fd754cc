"""`LLM`: offline generation in the shape vLLM users know, with optional speculative decoding.

    llm = LLM()  # qwen2.5-coder-1.5b-instruct with its 0.5B drafting, fetched on first use
    llm = LLM(model="file.gguf" or a HF directory)  # plain decoding unless speculative_config says
    llm = LLM(model=DIR, speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 5})
    outputs = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=64))
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.engine.budget import DraftBudget
from specdecode.engine.parts import fit_tree_width, load_target, make_controller, plan_batch
from specdecode.speculation.calibrate import calibration_name
from specdecode.engine.scheduler import Scheduler
from specdecode.engine.sequence import RequestOutput, Sequence, SpecStats
from specdecode.engine.step import StepRunner
from specdecode.errors import ConfigError
from specdecode.hardware import return_free_memory
from specdecode.model.gguf import find_gguf
from specdecode.model.cache import BLOCK_SIZE, KV_DTYPES
from specdecode.model.fim import FimTokens, fim_ids, require_fim
from specdecode.model.loading import read_config, resolve_device, resolve_quantization
from specdecode.model.quant import QUANTIZATIONS as KEPT_QUANTIZATIONS
from specdecode.model.tokenizer import Tokenizer
from specdecode.catalog.registry import default_speculative_config, model_name, prefetch, resolve_model
from specdecode.sampling import SamplingParams, choice_seed
from specdecode.speculation.config import SpeculativeConfig, build_proposer, with_shipped_speculator
from specdecode.speculation.control import SpecController
from specdecode.speculation.grammar import Grammar


def fim_params(params: SamplingParams, fim: FimTokens) -> SamplingParams:
    """params that also stop where a middle ends (the format's end tokens; the EOS stops it anyway)."""
    return dataclasses.replace(params, stop_token_ids=sorted({*(params.stop_token_ids or ()), *fim.stop_ids}))


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", device: str | None = None,
                 speculative_config: dict | SpeculativeConfig | str | None = "auto", max_num_seqs: int = 32,
                 max_model_len: int | None = None, quantization: str | None = "auto", tensor_parallel_size: int = 1,
                 draft_tensor_parallel_size: int | None = None, memory_budget: int | None = None,
                 gpu_memory_utilization: float | None = None, threads: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 block_size: int | None = BLOCK_SIZE, kv_cache_dtype: str = "auto",
                 num_kv_blocks: int | None = None):
        """model: a model name (default: qwen2.5-coder-1.5b-instruct, fetched on first use), a .gguf file, or a
        Hugging Face checkpoint directory.
        speculative_config: vLLM-style dict, e.g. {"method": "ngram", "num_speculative_tokens": 8}; None = plain
        decoding; "auto" (default) = the speculator shipped for a named model, as the CLI uses (the default model's
        is its 0.5B drafting; none for a path: a file or directory decodes plainly unless a dict says otherwise).
        Speculation is adaptive unless the config says {"adaptive": False} (then it always drafts K): each step
        drafts what pays, nothing for a request whose drafts do not; that times the target at start-up for every
        batch size up to max_num_seqs (seconds each).
        quantization: "auto" (default): a GGUF's matrices stay quantized as shipped on the CPU ("gguf", specdecode's
        own kernels, model/quant.py), float weights elsewhere; "none"/None: float weights; "q8_0", "q4_0", "q4_1":
        every matrix quantized to that format at load; "int8": torch's weight-only int8 (bfloat16 on CPU).
        tensor_parallel_size: ranks the target's heads and MLP are sharded over (processes on this machine: gloo
        on CPU, NCCL with one CUDA device each); this process is rank 0 and runs the proposer.
        draft_tensor_parallel_size: 1 (default): the draft model or head runs whole on rank 0.
        memory_budget (bytes per rank) or gpu_memory_utilization (fraction of each CUDA device): size the batch with
        the capacity plan (specdecode/plan.py): max_num_seqs becomes the most sequences of max_model_len that fit,
        the caches are allocated now, and a configuration where not even one fits is refused here.
        threads: CPU threads for torch (torch.set_num_threads, for the whole process; default: torch's choice; on
        a CPU shared with other work, 1 is often fastest for a small model).
        enable_prefix_caching: keys and values of full blocks stay indexed by their tokens (while their request runs
        and after it leaves), and a later prompt that begins with them shares them and prefills only the rest
        (engine/prefix_cache.py; vLLM's name).
        block_size: positions per block of the paged KV cache (memory follows the tokens held; vLLM's name);
        None: one preallocated row of max_model_len per sequence (the slots layout; always so under tensor
        parallelism).
        kv_cache_dtype: what the target's keys and values are stored as: "auto" (on CPU float16 where the quantized
        kernels run, else float32; the model's dtype elsewhere), "float32", "bfloat16" or "float16" (vLLM's name).
        num_kv_blocks: the paged pool's size in blocks, instead of the plan's (vLLM's num_gpu_blocks_override; a
        small pool makes the engine preempt, for tests and soaks).
        enable_chunked_prefill: a long prompt that arrives while other requests decode is prefilled in chunks of
        about one step's time between their steps, instead of stalling them for its whole prefill."""
        if threads is not None:
            if not isinstance(threads, int) or threads < 1:
                raise ConfigError(f"threads must be a positive integer, got {threads!r}")
            torch.set_num_threads(threads)
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if isinstance(speculative_config, str):
            if speculative_config != "auto":
                raise ConfigError(f"speculative_config must be a dict, None or 'auto', got {speculative_config!r}")
            speculative_config = default_speculative_config(model)
        self.model_name = model_name(model)
        prefetch(model, speculative_config)  # a named target and its named draft under one progress bar
        self.model_dir = resolve_model(model)
        self.device = resolve_device(device)
        self.spec_config = SpeculativeConfig.parse(with_shipped_speculator(speculative_config, model))
        quantization = resolve_quantization(quantization, self.model_dir, self.device, tensor_parallel_size)
        self.quantization = quantization
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block_size must be a positive integer or None, got {block_size!r}")
        block_size = block_size if tensor_parallel_size == 1 else None
        if num_kv_blocks is not None:
            if block_size is None or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
                raise ConfigError(f"num_kv_blocks must be a positive integer with a paged cache, got {num_kv_blocks!r}")
            longest = read_config(self.model_dir).max_position_embeddings
            context = min(max_model_len or longest, longest)
            if num_kv_blocks * block_size < context:
                raise ConfigError(f"num_kv_blocks {num_kv_blocks} holds {num_kv_blocks * block_size} positions, fewer "
                                  f"than one sequence of max_model_len {context}: raise it or lower max_model_len")
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be 'auto' or one of {', '.join(KV_DTYPES)}, got {kv_cache_dtype!r}")
        if kv_cache_dtype != "auto" and tensor_parallel_size > 1:
            raise ConfigError("kv_cache_dtype applies with tensor_parallel_size 1; leave it 'auto'")
        if kv_cache_dtype == "q8_0" and (quantization not in KEPT_QUANTIZATIONS or self.device.type != "cpu"):
            raise ConfigError("kv_cache_dtype q8_0 (the 8-bit cache) is read by the fused CPU kernels only: serve a "
                              "GGUF kept quantized on the CPU (quantization auto or gguf), or choose float16")
        self.plan, max_num_seqs = plan_batch(self.model_dir, self.spec_config, dtype, self.device, max_num_seqs,
                                             max_model_len, tensor_parallel_size, quantization, memory_budget,
                                             gpu_memory_utilization, block_size, kv_cache_dtype)
        self.tensor_parallel_size = tensor_parallel_size
        self.target = load_target(self.model_dir, dtype, self.device, quantization, tensor_parallel_size,
                                  draft_tensor_parallel_size)
        self.tokenizer = Tokenizer(self.model_dir, self.target.config.eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or self.target.config.max_position_embeddings,
                                 self.target.config.max_position_embeddings)
        self.proposer = build_proposer(self.spec_config, self.target, self.tokenizer, dtype, self.device,
                                       self.model_dir)
        self.runner = StepRunner(self.target, self.proposer)
        self.runner.prefix_caching = bool(enable_prefix_caching)
        self.runner.block_size = block_size
        self.runner.kv_dtype = KV_DTYPES.get(kv_cache_dtype)
        if kv_cache_dtype == "q8_0" and self.target.fused_kernel() is None:
            raise ConfigError("kv_cache_dtype q8_0 needs the fused CPU kernels, which this model does not run (not "
                              "every layer is block-quantized, or the kernels could not be built): choose float16")
        if self.plan is not None and block_size is not None:
            self.runner.num_blocks = self.plan.num_blocks()
        if num_kv_blocks is not None:
            self.runner.num_blocks = num_kv_blocks
        self.runner.chunked_prefill = bool(enable_chunked_prefill)
        controller = None
        if self.spec_config and self.spec_config.adaptive:
            self.spec_config = fit_tree_width(self.target, self.proposer, self.spec_config)
            controller = self.make_controller()
        self.draft_budget = DraftBudget(self.spec_config if self.proposer is not None else None,
                                        self.max_model_len, controller)
        self.total_stats = SpecStats()
        self._ids = itertools.count()
        if self.plan is not None:  # allocate what the plan counted now, not at the first long request
            self.runner.ensure_capacity(self.max_num_seqs, self.max_model_len, self.tree_size)
        return_free_memory()  # (what loading, requantizing and timing freed)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this LLM is collected)."""
        if self.tensor_parallel_size > 1:
            self.target.runtime.close()

    # -- requests -------------------------------------------------------------------------------------------

    def make_sequence(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                      grammar=None) -> Sequence:
        """A request's sequence; a structured one's grammar is compiled here unless given (already compiled)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids or text == "":  # "" still encodes to [BOS] with tokenizers that add one
            raise ConfigError("the prompt is empty; give at least one token of text")
        if params.n != 1:
            raise ConfigError("n > 1 is for generate() and chat() (and the server); a stream or a single sequence "
                              "is one completion: send n=1")
        vocab = self.target.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ConfigError(f"logit_bias names token {max(params.logit_bias)} but the vocabulary has {vocab} tokens")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                              "shorten the prompt")
        seq = Sequence(request_id or str(next(self._ids)), text, ids, params, self.tokenizer,
                       self.tokenizer.eos_token_ids)
        if params.structured is not None:
            seq.grammar = grammar if grammar is not None else Grammar(params.structured, self.tokenizer, vocab)
        return seq

    def make_controller(self) -> SpecController:
        """An adaptive speculation controller for this engine (times the machine: seconds, the first time these
        models run here; later starts read the times kept in the cache)."""
        stored_as = None
        if self.quantization == "gguf":  # (files that identify the models; float weights may change in place)
            files = [find_gguf(path) for path in (self.model_dir, self.spec_config.model) if path is not None]
            config = self.spec_config
            stored_as = calibration_name(config.method, config.max_depth, config.nodes_per_level, config.pass_widths,
                                         self.max_num_seqs, str(self.runner.kv_dtype or self.target.kv_dtype),
                                         [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f])
        return make_controller(self.target, self.proposer, self.spec_config, self.max_num_seqs, stored_as)

    @property
    def tree_size(self) -> int:
        """The most nodes one sequence adds to a step's target pass (0: plain decoding)."""
        return self.spec_config.tree_size if self.proposer is not None else 0

    @property
    def controller(self) -> SpecController | None:
        """The adaptive speculation controller (None: fixed K or plain decoding); the draft budget consults it."""
        return self.draft_budget.controller

    @controller.setter
    def controller(self, controller: SpecController | None) -> None:
        self.draft_budget.controller = controller

    def budget(self, seq: Sequence, k: int | None = None) -> int:
        """How many draft tokens to verify for this sequence this step (k, default fixed K, capped by what is left)."""
        return self.draft_budget.for_sequence(seq, k)

    def budgets(self, seqs: list[Sequence]) -> list[int]:
        """Draft tokens per sequence for one step (see DraftBudget)."""
        return self.draft_budget.for_step(seqs)

    def make_scheduler(self, num_slots: int, isolate_failures: bool = False) -> Scheduler:
        """A scheduler over this engine's runner, draft budget and totals."""
        return Scheduler(self.runner, self.draft_budget, self.total_stats, num_slots, isolate_failures)

    # -- generation -----------------------------------------------------------------------------------------

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, suffix: str | list[str] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; sequences run as one batch (up to max_num_seqs at once).
        suffix: fill in the middle: each prompt is the text before the cursor, its suffix (one for all, or one per
        prompt) the text after it, and the output is what goes between (model/fim.py; the model's vocabulary must
        have FIM tokens). Speculation drafts from the suffix as from the prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        texts = None
        if suffix is not None:
            texts, prompts, params = prompts, *self._fill_in_the_middle(prompts, params, suffix)
        groups = [[self.make_sequence(p, dataclasses.replace(sp, n=1, seed=choice_seed(sp.seed, i)))
                   for i in range(sp.n)] for p, sp in zip(prompts, params)]  # a prompt's choices side by side
        seqs = [s for group in groups for s in group]
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        for _ in self._run(seqs):
            bar.n = sum(s.finished for s in seqs)
            bar.refresh()
        bar.close()
        outputs = []
        for group in groups:
            out = group[0].output()
            for i, seq in enumerate(group[1:], 1):
                choice = seq.output().outputs[0]
                choice.index = i
                out.outputs.append(choice)
            outputs.append(out)
        for out, text in zip(outputs, texts or []):
            out.prompt = text
        return outputs

    def _fill_in_the_middle(self, prompts: list[str], params: list[SamplingParams], suffix: str | list[str]
                            ) -> tuple[list[list[int]], list[SamplingParams]]:
        """generate's prompts and suffixes as FIM prompt ids, and their params stopping where a middle ends."""
        fim = require_fim(self.tokenizer)
        suffixes = [suffix] * len(prompts) if isinstance(suffix, str) else list(suffix)
        if len(suffixes) != len(prompts) or any(not isinstance(s, str) for s in suffixes):
            raise ConfigError(f"suffix must be a string or one string per prompt; got {len(suffixes)} for "
                              f"{len(prompts)} prompts")
        if any(not isinstance(p, str) for p in prompts):
            raise ConfigError("a prompt with a suffix must be text (the code before the cursor), not token ids")
        return ([fim_ids(self.tokenizer, fim, p, s) for p, s in zip(prompts, suffixes)],
                [fim_params(sp, fim) for sp in params])

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Answer one conversation ([{"role": "user", "content": ...}, ...]) or a list of them, each rendered with
        the model's chat template (as vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        outputs = self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling_params, use_tqdm)
        for out, conversation in zip(outputs, conversations):
            out.prompt = self.tokenizer.apply_chat_template(conversation)
        return outputs

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
        """Yield the text of one prompt as it is generated; joined, it is `generate`'s text (with stop strings, text
        that could begin one is yielded once the next tokens show it does not)."""
        seq = self.make_sequence(prompt, params)
        self.last_stats = seq.stats  # (counted as it runs: what a stream closed early had generated)
        for deltas in self._run([seq]):
            if deltas.get(seq.request_id):
                yield deltas[seq.request_id]

    def _run(self, seqs: list[Sequence]) -> Iterator[dict[str, str]]:
        """Continuous batching over a fixed list of sequences; yields {request_id: new text} per step."""
        longest = max(min(len(s.token_ids) + s.params.max_tokens, self.max_model_len) for s in seqs)
        tree = self.tree_size
        slots = min(len(seqs), self.max_num_seqs)
        self.runner.ensure_capacity(slots, longest, tree)
        scheduler = self.make_scheduler(slots)
        for seq in seqs:
            scheduler.add(seq)
        try:
            while scheduler.has_work:
                yield scheduler.step().deltas
        finally:  # a stream closed early (Ctrl-C in chat) gives its rows back for the next request
            scheduler.abort_all()
