"""Features of a frozen target, computed once and cached on disk for training speculators.

For every token of every training conversation the cache keeps what EAGLE, Medusa and draft distillation
learn from: the token id, whether it belongs to an answer, the target's last-layer hidden state before the
final norm (the EAGLE feature; Medusa reads norm(feature)), the target's top-k next-token probabilities and,
when asked, the hidden states of further layers (EAGLE-3-style multi-layer features: `extra_layers`).
Shards are written whole and renamed into place, so an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specdecode.errors import ConfigError

TOP_K = 8
"""Target probabilities kept per position (the distillation targets)."""


@dataclasses.dataclass
class Example:
    ids: list[int]
    """Token ids of one conversation in the chat template."""
    is_answer: list[bool]
    """Per token: part of an assistant answer."""


@dataclasses.dataclass
class Shard:
    """One shard of the cache, memory-mapped. N tokens over S sequences."""

    tokens: np.ndarray  # [N] uint16, or int32 for a vocabulary past 65,536 ids (meta token_dtype)
    is_answer: np.ndarray  # [N] bool
    features: np.ndarray  # [N, D] bfloat16 stored as uint16
    topk_ids: np.ndarray  # [N, K] int32: the target's K most likely next tokens at each position
    topk_probs: np.ndarray  # [N, K] float16
    offsets: np.ndarray  # [S + 1] int64: sequence s is tokens[offsets[s]:offsets[s + 1]]
    extra: np.ndarray | None = None  # [N, E, D] bfloat16 as uint16: the hidden states of extra_layers
    extra_layers: tuple[int, ...] = ()

    @classmethod
    def open(cls, folder: Path) -> "Shard":
        meta = json.loads((folder / "meta.json").read_text())
        n, d, k = meta["tokens"], meta["hidden"], meta["top_k"]

        def mm(name, dtype, shape):
            return np.memmap(folder / name, dtype=dtype, mode="r", shape=shape)

        extra_layers = tuple(meta.get("extra_layers", ()))
        extra = mm("extra.bin", np.uint16, (n, len(extra_layers), d)) if extra_layers else None
        return cls(mm("tokens.bin", np.dtype(meta.get("token_dtype", "uint16")), (n,)),
                   mm("is_answer.bin", np.bool_, (n,)),
                   mm("features.bin", np.uint16, (n, d)), mm("topk_ids.bin", np.int32, (n, k)),
                   mm("topk_probs.bin", np.float16, (n, k)), np.load(folder / "offsets.npy"), extra, extra_layers)

    def sequence(self, s: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        out = {"tokens": torch.from_numpy(self.tokens[a:b].astype(np.int64)),
               "is_answer": torch.from_numpy(np.array(self.is_answer[a:b])),
               "features": torch.from_numpy(np.array(self.features[a:b])).view(torch.bfloat16),
               "topk_ids": torch.from_numpy(self.topk_ids[a:b].astype(np.int64)),
               "topk_probs": torch.from_numpy(self.topk_probs[a:b].astype(np.float32))}
        if self.extra is not None:
            out["extra"] = torch.from_numpy(np.array(self.extra[a:b])).view(torch.bfloat16)
        return out

    def __len__(self) -> int:
        return len(self.offsets) - 1


def open_cache(folder: Path) -> list[Shard]:
    shards = sorted(p for p in Path(folder).glob("shard-*") if (p / "meta.json").is_file())
    if not shards:
        raise ConfigError(f"{folder} holds no feature shards; run the feature stage of `specdecode train` first")
    return [Shard.open(p) for p in shards]


def _batches(examples: list[Example], max_batch_tokens: int):
    """Consecutive examples grouped so that batch size x longest example stays under the token budget."""
    batch, longest = [], 0
    for ex in examples:
        longest_if_added = max(longest, len(ex.ids))
        if batch and longest_if_added * (len(batch) + 1) > max_batch_tokens:
            yield batch
            batch, longest_if_added = [], len(ex.ids)
        batch.append(ex)
        longest = longest_if_added
    if batch:
        yield batch


@torch.inference_mode()
def _run_target(target, batch: list[Example], top_k: int, extra_layers: tuple[int, ...] = (),
                logit_chunk: int = 1024):
    """Target features [n_i, D], top-k (ids, probs) [n_i, K] and extra layers' hidden states [n_i, E, D] (None
    without extra layers) for each example of a batch (right-padded)."""
    T = max(len(ex.ids) for ex in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    for row, ex in enumerate(batch):
        ids[row, :len(ex.ids)] = torch.tensor(ex.ids)
    last = target.config.num_hidden_layers - 1
    out = target(ids.to(target.device), hidden_layers=(last, *extra_layers), compute_logits=False)
    feats = out.layer_hidden[last]  # [B, T, D], before the final norm
    extra = torch.stack([out.layer_hidden[i] for i in extra_layers], dim=2) if extra_layers else None
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])  # [B * T, D], normed
    top_ids, top_probs = [], []
    for start in range(0, hidden.shape[0], logit_chunk):
        logits = target.lm_head(hidden[start:start + logit_chunk]).float()  # [chunk, V]
        probs, idx = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        top_ids.append(idx)
        top_probs.append(probs)
    top_ids = torch.cat(top_ids).view(len(batch), T, top_k)
    top_probs = torch.cat(top_probs).view(len(batch), T, top_k)
    for row, ex in enumerate(batch):
        n = len(ex.ids)
        yield (feats[row, :n].cpu(), top_ids[row, :n].cpu(), top_probs[row, :n].cpu(),
               None if extra is None else extra[row, :n].cpu())


def _write_shard(folder: Path, examples: list[Example], outputs: list, hidden: int, top_k: int,
                 extra_layers: tuple[int, ...] = ()) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    lengths = [len(ex.ids) for ex in examples]
    token_dtype = "uint16" if max(max(ex.ids, default=0) for ex in examples) < 2**16 else "int32"  # Qwen: 151,936
    np.concatenate([np.array(ex.ids, dtype=token_dtype) for ex in examples]).tofile(tmp / "tokens.bin")
    np.concatenate([np.array(ex.is_answer, dtype=np.bool_) for ex in examples]).tofile(tmp / "is_answer.bin")
    torch.cat([o[0] for o in outputs]).to(torch.bfloat16).view(torch.uint16).numpy().tofile(tmp / "features.bin")
    torch.cat([o[1] for o in outputs]).to(torch.int32).numpy().tofile(tmp / "topk_ids.bin")
    torch.cat([o[2] for o in outputs]).to(torch.float16).numpy().tofile(tmp / "topk_probs.bin")
    if extra_layers:
        torch.cat([o[3] for o in outputs]).to(torch.bfloat16).view(torch.uint16).numpy().tofile(tmp / "extra.bin")
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    (tmp / "meta.json").write_text(json.dumps({"tokens": int(sum(lengths)), "sequences": len(examples),
                                               "hidden": hidden, "top_k": top_k, "extra_layers": list(extra_layers),
                                               "token_dtype": token_dtype}))
    tmp.rename(folder)


def extract(target, examples: list[Example], out_dir: Path, shard_tokens: int = 65536,
            max_batch_tokens: int = 8192, top_k: int = TOP_K, extra_layers: tuple[int, ...] = ()) -> int:
    """Run the frozen target over the examples (in their given order) and write the cache; returns tokens
    cached. Shards already on disk are kept: the examples they cover are skipped (when they hold the same
    extra layers)."""
    extra_layers = tuple(int(i) for i in extra_layers)
    layers = target.config.num_hidden_layers
    if any(not 0 <= i < layers - 1 for i in extra_layers):
        raise ConfigError(f"extra feature layers {list(extra_layers)}: choose layers 0..{layers - 2} (the last "
                          f"layer, {layers - 1}, is always cached)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups, group, size = [], [], 0
    for ex in examples:  # fixed shard boundaries: a function of the examples only
        group.append(ex)
        size += len(ex.ids)
        if size >= shard_tokens:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    total = sum(len(ex.ids) for ex in examples)
    hidden = target.config.hidden_size
    with tqdm(total=total, unit="tok", desc="target features", smoothing=0.05) as bar:
        for i, group in enumerate(groups):
            folder = out_dir / f"shard-{i:05d}"
            group_tokens = sum(len(ex.ids) for ex in group)
            if (folder / "meta.json").is_file():
                done = json.loads((folder / "meta.json").read_text())
                if (done["sequences"] == len(group) and done["tokens"] == group_tokens
                        and tuple(done.get("extra_layers", ())) == extra_layers):
                    bar.update(group_tokens)
                    continue
                import shutil  # a shard of an earlier run with another token budget: compute it again

                shutil.rmtree(folder)
            # Within a shard, similar lengths share a batch (less padding); the shard keeps that order.
            ordered = sorted(group, key=lambda ex: len(ex.ids))
            outputs = []
            for batch in _batches(ordered, max_batch_tokens):
                outputs.extend(_run_target(target, batch, top_k, extra_layers))
                bar.update(sum(len(ex.ids) for ex in batch))
            _write_shard(folder, ordered, outputs, hidden, top_k, extra_layers)
    return total


@dataclasses.dataclass
class FeatureBatch:
    """Right-padded sequences from the cache. B rows, T = the longest."""

    tokens: torch.Tensor  # [B, T] long
    valid: torch.Tensor  # [B, T] bool: not padding
    is_answer: torch.Tensor  # [B, T] bool
    features: torch.Tensor  # [B, T, D] bfloat16
    topk_ids: torch.Tensor  # [B, T, K] long
    topk_probs: torch.Tensor  # [B, T, K] float32
    extra: torch.Tensor | None = None  # [B, T, E, D] bfloat16: the cache's extra layers, when it has them
    extra_layers: tuple[int, ...] = ()

    def layer_features(self, layers: tuple[int, ...], last: int) -> list[torch.Tensor]:
        """The target's hidden states [B, T, D] at these layers (`last`: the cached features), float32."""
        missing = [i for i in layers if i != last and i not in self.extra_layers]
        if missing:
            raise ConfigError(f"the feature cache lacks layers {missing} (it holds {list(self.extra_layers)} and "
                              f"{last}): build another with `specdecode train features --extra-layers ...`")
        return [self.features.float() if i == last else self.extra[:, :, self.extra_layers.index(i)].float()
                for i in layers]

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def to(self, device: torch.device) -> "FeatureBatch":
        """The same batch on another device (itself on its own)."""
        if self.tokens.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return FeatureBatch(**{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                               for k, v in moved.items()})


def sample_batch(shards: list[Shard], batch_tokens: int, seed: int, step: int, max_len: int | None = None
                 ) -> FeatureBatch:
    """Random sequences (a function of seed and step only) until about batch_tokens tokens; each is cut to a
    random window of max_len tokens when longer."""
    rng = np.random.default_rng([seed, step])
    sizes = np.array([len(s) for s in shards])
    cumulative = np.cumsum(sizes)
    picked, total = [], 0
    while total < batch_tokens:
        i = int(rng.integers(cumulative[-1]))
        shard = int(np.searchsorted(cumulative, i, side="right"))
        seq = shards[shard].sequence(i - (int(cumulative[shard - 1]) if shard else 0))
        n = len(seq["tokens"])
        if max_len is not None and n > max_len:
            start = int(rng.integers(n - max_len + 1))
            seq = {k: v[start:start + max_len] for k, v in seq.items()}
        picked.append(seq)
        total += len(seq["tokens"])
    T = max(len(s["tokens"]) for s in picked)

    def stack(key, fill=0):
        first = picked[0][key]
        out = torch.full((len(picked), T, *first.shape[1:]), fill, dtype=first.dtype)
        for row, s in enumerate(picked):
            out[row, :len(s[key])] = s[key]
        return out

    valid = torch.zeros(len(picked), T, dtype=torch.bool)
    for row, s in enumerate(picked):
        valid[row, :len(s["tokens"])] = True
    return FeatureBatch(stack("tokens"), valid, stack("is_answer", False), stack("features"), stack("topk_ids"),
                        stack("topk_probs"), stack("extra") if "extra" in picked[0] else None,
                        shards[0].extra_layers)


def draft_vocabulary(shards: list[Shard], size: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens the target most often predicts (its greedy next token) in the cached answers, plus
    `always` (e.g. EOS), sorted: draft id -> target id."""
    greedy = [np.asarray(shard.topk_ids[:, 0])[np.asarray(shard.is_answer)] for shard in shards]
    ids = max([2**16, *(int(g.max()) + 1 for g in greedy if len(g)), *(int(t) + 1 for t in always)])
    counts = np.zeros(ids, dtype=np.int64)
    for g in greedy:
        counts += np.bincount(g, minlength=ids)
    counts[list(always)] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(top)).long()
