"""Capacity plan: how much device memory a serving configuration needs, and the largest batch that fits.

Counts what the engine allocates per rank (rank 0, which also holds the proposer): the target's weights (its
1/N share of every layer under tensor parallelism, embeddings and LM head whole) plus the derived copy that a
packed linear backend keeps (oneDNN on x86 CPUs, see model/linear.py); the draft model or speculator heads; the KV
caches; and activations, taken at their peak. Paged (the default), the KV caches are one pool of blocks taking what
the weights and activations leave (target and draft alike, so many positions each), the activations' peak is one
prefill of MAX_PREFILL_TOKENS (longer prompts run in chunks of that) plus each sequence's step logits, and a
configuration fits when one sequence of max_model_len fits the pool; in the slots layout every sequence holds
max_model_len plus one verified tree, and the peak is a prefill of every slot's full-length prompt at once. A
fraction of the budget (headroom, default 15%) is left unplanned for the allocator, fragmentation and the runtime.
`specdecode plan` prints it; LLM(memory_budget=...) sizes its batch with it and refuses at start-up what does not
fit.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.errors import ConfigError
from specdecode.model.config import ModelConfig

if TYPE_CHECKING:  # torch and the loader are imported where they are used: `specdecode --help` imports this module
    import torch

GiB = 1024 ** 3

MAX_PREFILL_TOKENS = 4096
"""The most tokens one prefill runs (a batch's rows padded to its longest): a longer prompt is prefilled in chunks
of this many (engine/scheduler.py), which bounds the activations' peak of a paged plan."""

RUNTIME_BYTES = 300 * 2**20
"""What a server process holds beside its models and caches: Python, torch, the server's libraries and the compiled
kernels (measured 0.23-0.30 GiB on torch 2.13, Linux x86-64; printed by `plan`, not planned within the budget: the
budget is what the models and caches may take)."""
TOKENIZER_BYTES_PER_TOKEN = 512
"""A loaded tokenizer's memory per vocabulary entry (Qwen2.5's 151,936 entries: 68-78 MB measured)."""

DEFAULT_HEADROOM = 0.15
"""Fraction of the budget never planned for (the seeds' advice: keep 15-20%)."""


@dataclasses.dataclass
class Memory:
    """What one model (target, draft or heads) costs on rank 0."""

    weights: int
    """Bytes of parameters, plus the packed linear copies where the backend keeps them."""
    kv_per_position: int = 0
    """KV-cache bytes per cached position of one sequence."""
    kv_extra_positions: int = 0
    """Positions each cache row holds beyond max_model_len (one verified tree, drafts in flight)."""


@dataclasses.dataclass
class MemoryPlan:
    """The figures `specdecode plan` prints, per rank, in bytes."""

    budget: int
    """Device memory per rank."""
    headroom: float
    """Fraction of the budget left unplanned."""
    max_model_len: int
    """Positions per sequence."""
    max_num_seqs: int
    """Sequences asked for."""
    target: Memory
    """The target (this rank's shard)."""
    draft: Memory
    """The draft model or speculator heads (rank 0); zero for model-free methods."""
    activation_per_seq: int
    """Peak activation bytes per sequence (a full-length prefill row and its share of a step's logits)."""
    tensor_parallel_size: int = 1
    """Ranks the target is sharded over."""
    block_size: int | None = None
    """Positions per block of the paged KV caches; None: the slots layout (a row of max_model_len a sequence)."""
    activation_per_token: int = 0
    """Activation bytes per prefilled token (a layer's live tensors)."""
    step_logits: int = 0
    """Activation bytes of one sequence's step logits (and processed probabilities)."""
    draft_paged: bool = False
    """Whether the draft's KV cache shares the paged layout (a draft model: yes; EAGLE's one-layer cache: no, it
    keeps a row of max_model_len per sequence)."""
    runtime: int = 0
    """Bytes of the process beside the models and caches (RUNTIME_BYTES and the tokenizer), outside the budget."""

    def kv_per_seq(self) -> int:
        return sum(m.kv_per_position * (self.max_model_len + m.kv_extra_positions) for m in (self.target, self.draft))

    def kv_per_position(self) -> int:
        """KV bytes of one position in every paged cache (the target's, and a draft model's)."""
        return self.target.kv_per_position + (self.draft.kv_per_position if self.draft_paged else 0)

    def unpaged_kv(self, seqs: int | None = None) -> int:
        """Paged plan: KV bytes of a draft cache kept in rows (EAGLE's), max_model_len and its tree room a row."""
        if self.draft_paged:
            return 0
        seqs = self.max_num_seqs if seqs is None else seqs
        return seqs * self.draft.kv_per_position * (self.max_model_len + self.draft.kv_extra_positions)

    def row_extra(self, seqs: int | None = None) -> int:
        """KV bytes of every row's tree room in the paged caches (positions a step writes beyond its tokens)."""
        seqs = self.max_num_seqs if seqs is None else seqs
        paged = (self.target, self.draft) if self.draft_paged else (self.target,)
        bs = self.block_size or 1  # (in whole blocks)
        return seqs * sum(m.kv_per_position * -(-m.kv_extra_positions // bs) * bs for m in paged)

    def pool_positions(self) -> int:
        """Paged: positions the pool holds (in whole blocks) once weights, activations and tree rooms are planned."""
        left = (self.usable() - self.target.weights - self.draft.weights - self.activations() - self.row_extra()
                - self.unpaged_kv())
        positions = max(0, left) // max(1, self.kv_per_position())
        return positions // self.block_size * self.block_size

    def num_blocks(self) -> int:
        """Paged: blocks of the target's pool (the positions, and every row's tree room)."""
        room = -(-self.target.kv_extra_positions // self.block_size)
        return self.pool_positions() // self.block_size + self.max_num_seqs * room

    def sessions(self, tokens: int) -> int:
        """Sequences of `tokens` tokens the KV caches hold at once (paged: the pool; slots: max_num_seqs if they fit
        a row)."""
        if self.block_size is None:
            return self.max_num_seqs if tokens <= self.max_model_len else 0
        return self.pool_positions() // tokens

    def kv(self, seqs: int | None = None) -> int:
        if self.block_size is not None:  # the whole pool, allocated at start-up
            return self.pool_positions() * self.kv_per_position() + self.row_extra(seqs) + self.unpaged_kv(seqs)
        return self.kv_per_seq() * (self.max_num_seqs if seqs is None else seqs)

    def activations(self, seqs: int | None = None) -> int:
        if self.block_size is not None:
            prefill = min(self.max_model_len, MAX_PREFILL_TOKENS) * self.activation_per_token
            return prefill + self.step_logits * (self.max_num_seqs if seqs is None else seqs)
        return self.activation_per_seq * (self.max_num_seqs if seqs is None else seqs)

    def usable(self) -> int:
        return int(self.budget * (1 - self.headroom))

    def needed(self, seqs: int | None = None) -> int:
        """Bytes planned (paged: weights, activations and a pool that holds one sequence of max_model_len)."""
        if self.block_size is not None:
            return (self.target.weights + self.draft.weights + self.activations(seqs) + self.row_extra(seqs)
                    + self.unpaged_kv(seqs) + self.max_model_len * self.kv_per_position())
        return self.target.weights + self.draft.weights + self.kv(seqs) + self.activations(seqs)

    def planned(self) -> int:
        """Bytes the engine allocates (paged and fitting: the whole pool; else what it needs)."""
        if self.block_size is not None and self.fits:
            return self.target.weights + self.draft.weights + self.kv() + self.activations()
        return self.needed()

    def largest_batch(self) -> int:
        """The most sequences that may run at once (0: not even one): slots, those of max_model_len that fit the
        usable budget; paged, max_num_seqs when the pool holds one sequence of max_model_len (rows cost no memory
        of their own: the pool's blocks follow the tokens)."""
        if self.block_size is not None:
            return self.max_num_seqs if self.pool_positions() >= self.max_model_len else 0
        free = self.usable() - self.target.weights - self.draft.weights
        return max(0, free // (self.kv_per_seq() + self.activation_per_seq))

    @property
    def fits(self) -> bool:
        return self.needed() <= self.usable()

    def refusal(self) -> str:
        """Why the configuration does not fit, and what to change."""
        largest = self.largest_batch()
        fix = (f"lower --max-num-seqs to {largest}" if largest and self.block_size is None else
               "not even one sequence fits: shorten --max-model-len, use a smaller dtype or more tensor-parallel ranks")
        return (f"this configuration needs {self.needed() / GiB:.2f} GiB per rank but "
                f"{self.usable() / GiB:.2f} GiB may be planned ({self.budget / GiB:.2f} GiB less "
                f"{self.headroom:.0%} headroom); {fix}, or give more memory")

    def render(self) -> str:
        paged = self.block_size is not None
        kv = (f"KV cache pool ({self.num_blocks()} blocks of {self.block_size}, paged)" if paged
              else f"KV cache ({self.max_num_seqs} x {self.max_model_len} positions)")
        peak = (f"activations (peak: a {min(self.max_model_len, MAX_PREFILL_TOKENS)}-token prefill)" if paged
                else "activations (peak: prefill of every slot)")
        rows = [("target weights" + (f" (1/{self.tensor_parallel_size} of the layers)"
                                     if self.tensor_parallel_size > 1 else ""), self.target.weights),
                ("draft / heads weights", self.draft.weights),
                (kv, self.kv()),
                (peak, self.activations()),
                ("total needed" if not paged or not self.fits else "total planned", self.planned()),
                (f"budget per rank less {self.headroom:.0%} headroom", self.usable())]
        lines = [f"{name:<48} {value / GiB:9.3f} GiB" for name, value in rows]
        left = self.usable() - self.planned()
        if left >= 0:
            lines.append(f"{'left beyond that':<48} {left / GiB:9.3f} GiB"
                         f" ({(self.budget - self.planned()) / self.budget:.0%} of the budget unused in all)")
        else:
            lines.append(f"{'short by':<48} {-left / GiB:9.3f} GiB")
        lines.append(f"{'runtime (Python, torch, tokenizer), beside it':<48} {self.runtime / GiB:9.3f} GiB")
        idle = self.target.weights + self.draft.weights + self.runtime
        lines.append(f"resident when idle (models and runtime): {idle / GiB:.2f} GiB; the KV cache's pages are taken "
                     f"as blocks are first used, up to {(self.planned() + self.runtime) / GiB:.2f} GiB")
        if paged:
            lines.append(f"the pool holds {self.pool_positions():,} positions: "
                         f"{self.pool_positions() // self.max_model_len} sequences of {self.max_model_len}, "
                         f"{self.sessions(1000)} of 1,000 tokens; up to {self.max_num_seqs} run at once")
        else:
            lines.append(f"largest batch at {self.max_model_len} positions: {self.largest_batch()} sequences")
        return "\n".join(lines)


def _layer_linear_params(c: ModelConfig, tp: int) -> int:
    """Weights (and attention biases) of one decoder layer's linear layers on one of tp ranks."""
    d, hd = c.hidden_size, c.head_dim
    attn = d * c.num_attention_heads * hd * 2 + d * c.num_key_value_heads * hd * 2
    bias = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd if c.attention_bias else 0
    return (attn + bias + 3 * d * c.intermediate_size) // tp


def _layer_other_params(c: ModelConfig) -> int:
    return 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)


def model_memory(c: ModelConfig, itemsize: int, kv_itemsize: int, packed: bool, tp: int = 1,
                 extra_positions: int = 0, quantized: float | None = None, in_file: bool = False,
                 head_rows: int | None = None) -> Memory:
    """A decoder's weights and KV cache per position on one of tp ranks. quantized: bytes per weight of the
    matrices where they stay block-quantized (model/quant.py; no packed copies then); in_file: a GGUF's, whose
    embedding rows are read from the file's memory map (not resident: only the output head's packed copy counts);
    head_rows: rows of the output head (a draft's restricted vocabulary, draft_model.py's DRAFT_VOCAB)."""
    linear = c.num_hidden_layers * _layer_linear_params(c, tp)
    embed = c.vocab_size * c.hidden_size
    matrices = linear + embed * (1 if c.tie_word_embeddings else 2)
    other = c.num_hidden_layers * _layer_other_params(c) + c.hidden_size  # norms, biases; the final norm
    kv = int(2 * c.num_hidden_layers * (c.num_key_value_heads // tp) * c.head_dim * kv_itemsize)
    if quantized is not None:
        if in_file:
            matrices = linear + (c.vocab_size if head_rows is None else head_rows) * c.hidden_size
        return Memory(int(matrices * quantized) + other * itemsize, kv, extra_positions)
    copies = (linear + embed) if packed else 0  # every linear layer, the LM head too (tied or not)
    return Memory((matrices + other + copies) * itemsize, kv, extra_positions)


def quantized_bytes_per_weight(model_dir: Path, quantization: str | None) -> float | None:
    """Bytes per weight of a kept-quantized target's matrices: a format's block size, or for 'gguf' the file's
    own average (its size over its weights: an upper bound, the file also holds the tokenizer); None for float."""
    from specdecode.model.gguf import find_gguf
    from specdecode.model.quant import BLOCKS, bytes_per_weight

    if quantization in BLOCKS:
        return bytes_per_weight(quantization)
    if quantization != "gguf":
        return None
    from specdecode.model.loading import read_config

    c = read_config(model_dir)
    weights = (c.num_hidden_layers * _layer_linear_params(c, 1)
               + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2))
    return find_gguf(model_dir).stat().st_size / weights


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header, without reading the tensors."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def head_memory(folder: Path, target: ModelConfig, itemsize: int, kv_itemsize: int, packed: bool,
                extra_positions: int) -> Memory:
    """EAGLE or Medusa heads: their stored weights, the output rows they copy from the target (draft vocabulary
    x hidden), and (EAGLE) one decoder layer's KV cache."""
    import torch

    shapes = _safetensors_shapes(folder / "model.safetensors")
    draft_vocab = shapes.pop("draft_to_target")[0]
    stored = sum(torch.Size(s).numel() for s in shapes.values())
    linear = sum(torch.Size(s).numel() for k, s in shapes.items() if k.endswith("weight") and len(s) == 2)
    rows = draft_vocab * target.hidden_size
    params = stored + rows + 2 * target.hidden_size  # the EAGLE decoder's own norm and 1-row embedding
    copies = (linear + rows) if packed else 0
    kind = json.loads((folder / "config.json").read_text())["kind"]
    kv = 2 * target.num_key_value_heads * target.head_dim * kv_itemsize if kind == "eagle" else 0
    return Memory((params + copies) * itemsize, kv, extra_positions)


def plan_memory(model_dir: str | Path, budget: int, max_model_len: int | None, max_num_seqs: int,
                speculative=None, dtype: str = "auto", device: str | None = None, tensor_parallel_size: int = 1,
                headroom: float = DEFAULT_HEADROOM, quantization: str | None = None,
                block_size: int | None = None, kv_cache_dtype: str = "auto") -> MemoryPlan:
    """The plan of a configuration (speculative: a parsed SpeculativeConfig or None; block_size: paged KV caches,
    None: the slots layout; tensor parallelism always runs the slots layout)."""
    from specdecode.parallel.tp import check_divisible
    from specdecode.model.linear import resolve_backend
    from specdecode.model.loading import read_config, resolve_device, resolve_dtype

    if not 0.0 <= headroom < 1.0:
        raise ConfigError(f"headroom must be in [0, 1), got {headroom}")
    if quantization == "int8":
        raise ConfigError("the capacity plan does not count int8 weights; plan without --quantization int8")
    config = read_config(model_dir)
    check_divisible(config, tensor_parallel_size)
    device = resolve_device(device)
    quantized = quantized_bytes_per_weight(Path(model_dir), quantization)
    # kept-quantized matrices run float32 activations under "auto" (as load_model decides)
    dtype = resolve_dtype("float32" if quantized is not None and dtype == "auto" else dtype, device)
    itemsize = dtype.itemsize
    # see LlamaForCausalLM.kv_dtype: float16 on CPU where the fused kernels run (kept-quantized float32 models)
    kv_itemsize = (2 if quantized is not None and itemsize == 4 else 4) if device.type == "cpu" else itemsize
    # (q8_0: a byte a value and a float16 scale per 32: 17/16 of a byte)
    target_kv_itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "q8_0": 17 / 16}.get(kv_cache_dtype, kv_itemsize)
    packed = resolve_backend("auto", device, dtype) == "onednn"
    max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    tree = speculative.tree_size if speculative is not None else 0
    target = model_memory(config, itemsize, target_kv_itemsize, packed, tensor_parallel_size, tree + 2, quantized,
                          in_file=quantization == "gguf")
    draft = Memory(0)
    counted = speculative.method_info.memory(speculative) if speculative is not None else None
    if counted is not None:
        extra = tree + 2 + speculative.method_info.cache_margin(speculative)  # the proposer's own cache rows
        if counted == "decoder":  # a draft checkpoint: block-quantized beside a block-quantized target (as shipped
            # if a GGUF, else Q8_0: draft_model.py)
            from specdecode.model.gguf import find_gguf
            from specdecode.model.quant import SPECULATOR_FORMAT, bytes_per_weight
            from specdecode.speculation.proposers.draft_model import DRAFT_VOCAB, LIGHT_FORMAT

            draft_quantization = None if quantization is None else (
                "gguf" if find_gguf(speculative.model) is not None else SPECULATOR_FORMAT)
            draft_config = read_config(speculative.model)
            per_weight = quantized_bytes_per_weight(Path(speculative.model), draft_quantization)
            head_rows = None
            if per_weight is not None:  # (draft_model.py: a restricted head; a GGUF's matrices lightened)
                head_rows = DRAFT_VOCAB if draft_config.vocab_size > 2 * DRAFT_VOCAB else None
                if draft_quantization == "gguf":
                    per_weight = min(per_weight, bytes_per_weight(LIGHT_FORMAT))
            draft = model_memory(draft_config, itemsize, kv_itemsize, packed, 1, extra, per_weight,
                                 in_file=draft_quantization == "gguf", head_rows=head_rows)
        else:  # "heads": a speculator directory
            draft = head_memory(Path(speculative.model), config, itemsize, kv_itemsize, packed, extra)
    d, tp = config.hidden_size, tensor_parallel_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim // tp
    per_token = (5 * d + qkv + 3 * config.intermediate_size // tp) * itemsize  # a layer's live tensors
    step_logits = (1 + tree) * config.vocab_size * 4 * 2  # float32 logits and processed probabilities
    activation_per_seq = max_model_len * per_token + step_logits
    return MemoryPlan(budget, headroom, max_model_len, max_num_seqs, target, draft, activation_per_seq, tp,
                      block_size if tp == 1 else None, per_token, step_logits, counted == "decoder",
                      RUNTIME_BYTES + TOKENIZER_BYTES_PER_TOKEN * config.vocab_size)


def memory_budget_bytes(device: torch.device, memory_budget: int | None,
                        gpu_memory_utilization: float | None) -> int | None:
    """Bytes per rank the engine may plan for: memory_budget as given, or a fraction of a CUDA device's memory."""
    import torch

    if memory_budget is not None and gpu_memory_utilization is not None:
        raise ConfigError("give memory_budget or gpu_memory_utilization, not both")
    if gpu_memory_utilization is None:
        if memory_budget is not None and memory_budget <= 0:
            raise ConfigError(f"memory_budget must be > 0 bytes, got {memory_budget}")
        return memory_budget
    if device.type != "cuda":
        raise ConfigError("gpu_memory_utilization applies to CUDA devices; on the CPU give a byte budget "
                          "(--memory-budget GiB)")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(torch.cuda.get_device_properties(device).total_memory * gpu_memory_utilization)


def module_bytes(*modules) -> int:
    """Bytes the modules hold: distinct parameter and buffer storages, plus packed linear copies."""
    import torch

    from specdecode.model.linear import PackedLinear

    seen, total = set(), 0  # storages and modules shared between the modules are counted once
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        for sub in module.modules():
            if isinstance(sub, PackedLinear) and isinstance(sub.packed, torch.Tensor) and id(sub) not in seen:
                seen.add(id(sub))
                total += sub.packed.numel() * sub.packed.element_size()
    return total


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v])


def device_memory(device: torch.device) -> int:
    """Bytes a plan may assume by default: a CUDA device's total memory, or the memory available now on a CPU."""
    import torch

    from specdecode.hardware import available_memory

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available = available_memory()
    if available is None:
        raise ConfigError("cannot read how much memory this machine has; give --device-memory GiB")
    return available
