"""`specdecode train eagle | medusa | draft`: the target's features (cached once) -> a head or a small draft
model -> a speculator directory with its card."""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.model.digest import weights_digest
from specdecode.train import features, loop, speculators
from specdecode.train.heads import (HeadLossConfig, draft_loss, draft_outputs, eagle_loss, eagle_unroll, init_eagle,
                                    medusa_loss, medusa_outputs)

RANKS = (1, 2, 3, 5, 10)
"""Ranks at which held-out top-r accuracy is reported."""


def _feature_cache(args, tokenizer, data_path: Path, folder: Path, max_tokens: int, heldout: bool,
                   extra_layers: tuple[int, ...] = ()) -> list:
    """Open the cache in folder, computing it first (resumably, with extra_layers) when it is not complete."""
    source = str(data_path / "heldout" if heldout and data_path.is_dir() else data_path)
    if (folder / "data.json").is_file():
        made = json.loads((folder / "data.json").read_text())
        made_from = made.get("corpus") or made.get("file")
        if made_from != source:
            raise ConfigError(f"--features {args.features} holds the features of {made_from}, not of {source}: "
                              "pass another --features folder")
        if not set(extra_layers) <= set(made.get("extra_layers", ())):
            raise ConfigError(f"--features {folder} holds layers {made.get('extra_layers', [])} beside the last, not "
                              f"{list(extra_layers)}: pass another --features folder (or build one with `specdecode "
                              f"train features --extra-layers {','.join(map(str, extra_layers))}`)")
    else:
        from specdecode.model.loading import load_model

        target = load_model(args.model, dtype=args.feature_dtype, device=args.device)
        if heldout:
            examples = speculators.heldout_examples(tokenizer, data_path, max_tokens, args.seq_len)
            tokens = features.extract(target, examples, folder, extra_layers=extra_layers)
            data = {("corpus" if data_path.is_dir() else "file"): source, "examples": len(examples), "tokens": tokens,
                    "answer_tokens": sum(sum(ex.is_answer) for ex in examples), "extra_layers": list(extra_layers)}
        else:
            data = speculators.build_feature_cache(target, tokenizer, data_path, folder, max_tokens, args.seq_len,
                                                   extra_layers=extra_layers)
        (folder / "data.json").write_text(json.dumps(data, indent=1) + "\n")
    return features.open_cache(folder)


def _loss_fn(kind: str, target, t2d: torch.Tensor, loss_cfg: HeadLossConfig, bf16: bool):
    generator = torch.Generator().manual_seed(0)  # on the CPU whatever the device: the same noise on any machine

    def loss_fn(head, batch):
        with torch.autocast(t2d.device.type, dtype=torch.bfloat16, enabled=bf16):
            if kind == "eagle":
                return eagle_loss(head, batch, t2d, loss_cfg, generator if head.training else None)
            if kind == "draft":
                return draft_loss(head, batch, t2d)
            return medusa_loss(head, batch, t2d, target.model.norm)
    return loss_fn


@torch.no_grad()
def heldout_accuracy(kind: str, head, shards, t2d: torch.Tensor, target, loss_cfg: HeadLossConfig,
                     batches: int = 16, batch_tokens: int = 4096) -> list[list[float]]:
    """Per depth (eagle) or head (medusa): P(the target's greedy token is in the head's top r), r in RANKS,
    over held-out answers (eagle's depths conditioned on the earlier tokens being right: teacher forcing)."""
    head.eval()
    hits, counts = None, None
    for b in range(batches):
        batch = features.sample_batch(shards, batch_tokens, seed=12345, step=b).to(t2d.device)
        ranks = _greedy_ranks(kind, head, batch, t2d, target, loss_cfg)
        if hits is None:
            hits = [[0] * len(RANKS) for _ in ranks]
            counts = [0] * len(ranks)
        for depth, r in enumerate(ranks):
            counts[depth] += len(r)
            for j, top in enumerate(RANKS):
                hits[depth][j] += int((r < top).sum())
    return [[round(h / max(1, c), 4) for h in row] for row, c in zip(hits, counts)]


def _greedy_ranks(kind, head, batch, t2d, target, loss_cfg) -> list[torch.Tensor]:
    """For each depth/head, the rank of the target's greedy token among the head's logits (10**6 when it is not
    in the top max(RANKS))."""
    if kind == "eagle":
        outputs = eagle_unroll(head, batch, t2d, loss_cfg)
    elif kind == "draft":
        outputs = draft_outputs(head, batch, t2d)
    else:
        outputs = medusa_outputs(head, batch, t2d, target.model.norm)
    ranks = []
    for out in outputs:
        order = out.logits.float().topk(max(RANKS), dim=-1).indices  # [N, R]
        match = order == out.topk_draft[:, :1]
        ranks.append(torch.where(match.any(-1), match.float().argmax(-1), torch.full_like(match[:, 0], 10**6,
                                                                                          dtype=torch.long)).cpu())
    return ranks


def _draft_init(args) -> Path | None:
    """The checkpoint --draft-init names, after checking that it can start this target's draft (None without it)."""
    from specdecode.catalog.registry import resolve_model
    from specdecode.model.loading import read_config

    if not getattr(args, "draft_init", None):
        return None
    init = resolve_model(args.draft_init)
    config, target = read_config(init), read_config(args.model)
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"--draft-init {args.draft_init} scores {config.vocab_size} tokens, the target "
                          f"{target.vocab_size}: start from a model with the target's tokenizer")
    if args.draft_layers > config.num_hidden_layers:
        raise ConfigError(f"--draft-layers {args.draft_layers}: --draft-init {args.draft_init} has "
                          f"{config.num_hidden_layers} decoder layers; keep at most that many")
    return Path(init)


def run(args) -> int:
    """Train one head as `args` says and write its speculator directory."""
    from specdecode.model.loading import load_model, read_config, resolve_device
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.speculation.heads import EagleHead, HeadConfig, MedusaHeads, save_head
    from specdecode.train.heads import draft_from_model, draft_from_target

    from specdecode.catalog.registry import resolve_model

    speculators.set_threads(args.threads)
    kind = args.kind
    args.device = resolve_device(args.device)
    args.model = resolve_model(args.model)
    tokenizer = Tokenizer(args.model)
    data_path = speculators.resolve_data(args.data)
    feature_layers = tuple(args.feature_layers or ()) if kind == "eagle" else ()
    last = read_config(args.model).num_hidden_layers - 1
    init = _draft_init(args) if kind == "draft" else None  # checked before the slow work
    extra = tuple(sorted(set(feature_layers) - {last}))
    shards = _feature_cache(args, tokenizer, data_path, args.features, args.max_tokens, False, extra)
    held = _feature_cache(args, tokenizer, data_path, args.features / "heldout", args.heldout_tokens, True, extra)
    # (a draft reads nothing of the target but its embedding, and its digest rounds to bfloat16 anyway: half the memory)
    target = load_model(args.model, dtype="bfloat16" if kind == "draft" else "float32", device="cpu")
    target.requires_grad_(False)
    digest = weights_digest(target)
    target = target.to(args.device)
    torch.manual_seed(args.seed)
    if init is not None:  # a smaller model of the family, cut to its first layers and its last
        d2t = torch.arange(target.config.vocab_size)
        head = draft_from_model(load_model(init, dtype="float32", device="cpu"), args.draft_layers)
    elif kind == "draft":  # a whole model in the target's vocabulary
        d2t = torch.arange(target.config.vocab_size)
        head = draft_from_target(target, args.draft_hidden, args.draft_layers, 4 * args.draft_hidden)
    else:
        d2t = features.draft_vocabulary(shards, args.draft_vocab, tokenizer.eos_token_ids)
        head = (EagleHead(target, d2t, feature_layers or None) if kind == "eagle"
                else MedusaHeads(target, d2t, args.num_heads))
        if kind == "eagle":
            init_eagle(head, target, args.eagle_init)
    head = head.to(args.device)
    t2d = speculators.target_to_draft_map(d2t, target.config.vocab_size).to(args.device)
    loss_cfg = HeadLossConfig(unroll=args.unroll)
    cfg = loop.TrainConfig(steps=args.steps, batch_size=1, seq_len=args.batch_tokens, lr=args.lr,
                           warmup_steps=min(args.steps, 50), weight_decay=0.0, seed=args.seed,
                           checkpoint_every=25, log_every=5)

    def batch_at(step):
        return features.sample_batch(shards, args.batch_tokens, cfg.seed, step, max_len=args.window).to(args.device)

    started = time.time()
    if args.export_only:  # a run stopped before its schedule ended: export its last checkpoint as it is
        ckpt = torch.load(loop.checkpoint_path(args.run_dir), map_location="cpu", weights_only=False)
        loop.load_weights(head, ckpt["model"])
        summary = {k: ckpt[k] for k in ("step", "tokens_seen", "wall_time_s")}
    else:
        summary = loop.train(head, _loss_fn(kind, target, t2d, loss_cfg, args.bf16), batch_at, cfg, args.run_dir,
                             resume=args.resume, desc=f"train {kind}")
    summary["scheduled_steps"] = cfg.steps
    accuracy = heldout_accuracy(kind, head, held, t2d, target, loss_cfg)
    head = head.cpu()  # exported from the CPU (an EAGLE head takes the target's embedding along: no longer needed)
    data = json.loads((args.features / "data.json").read_text())
    heldout_data = json.loads((args.features / "heldout" / "data.json").read_text())
    argv = [a for a in sys.argv[1:] if a not in ("--resume", "--export-only")]
    info = {"kind": kind, "command": "specdecode " + " ".join(shlex.quote(a) for a in argv),
            "target": str(args.model), "target_sha256": digest, "data": data, "heldout_data": heldout_data,
            "draft_vocab_size": len(d2t), "feature_layers": list(getattr(head, "feature_layers", ())) or None,
            "train": summary, "this_run_wall_time_s": round(time.time() - started, 1),
            "heldout_topk_accuracy": {"ranks": list(RANKS), "per_depth": accuracy}}
    if kind == "draft":
        save_draft(head, tokenizer, args.out, card(info))
    else:
        config = HeadConfig(kind=kind, target_sha256=digest, draft_vocab_size=len(d2t),
                            num_heads=args.num_heads if kind == "medusa" else 1,
                            topk_accuracy=[row[:] for row in accuracy], topk_ranks=list(RANKS),
                            feature_layers=list(head.feature_layers) if kind == "eagle" and extra else None)
        save_head(head, config, args.out, card(info))
    (Path(args.out) / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info["heldout_topk_accuracy"], indent=1))
    return 0


def save_draft(draft, tokenizer, folder: Path, card_text: str) -> None:
    """A Hugging Face directory: config.json, model.safetensors (bfloat16) and the target's tokenizer."""
    from specdecode.model.loading import save_model

    folder = Path(folder)
    save_model(draft, folder, dtype=torch.bfloat16)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
        "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template}, indent=1) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_ids}) + "\n")
    (folder / "README.md").write_text(card_text)


def card(info: dict) -> str:
    """The speculator's card: what it is, how it was made, how well it predicts the target on held-out text."""
    acc = info["heldout_topk_accuracy"]
    name = {"eagle": "depth", "medusa": "head", "draft": "next token"}[info["kind"]]
    rows = "\n".join(f"| {name} {i + 1} | " + " | ".join(f"{a:.1%}" for a in row) + " |"
                     for i, row in enumerate(acc["per_depth"]))
    return f"""# {info["kind"]} speculator for {Path(info["target"]).name}

Trained by specdecode for the target whose weights hash to sha256 `{info["target_sha256"]}`; refused on any
other weights.

Command: `{info["command"]}`

{_data_section(info)}
## Training

{info["train"]["step"]} steps (of a {info["train"]["scheduled_steps"]}-step schedule; fewer means the run was stopped
for time and its last checkpoint exported), {info["train"]["tokens_seen"]} tokens seen, {info["train"]["wall_time_s"] / 60:.1f}
minutes of training on this machine (features excluded). Draft vocabulary: the {info["draft_vocab_size"]} tokens
the target most often predicts in the cached answers.

## Held-out accuracy

P(the target's greedy next token is among the head's top r), on held-out answers with the earlier tokens
given (teacher forcing):

| | {" | ".join(f"top {r}" for r in acc["ranks"])} |
|---|{"---|" * len(acc["ranks"])}
{rows}
"""


def _data_section(info: dict) -> str:
    data, held = info["data"], info.get("heldout_data", {})
    if "corpus" in data:
        settings, stats = data["corpus_settings"], data.get("corpus_stats") or {}
        return f"""## Data

The target's own answers: the self-distilled corpus {data["corpus"]} (version {settings["version"]}, made by
`specdecode train corpus`; {stats.get("prompts")} prompts of ShareGPT's {settings["split"]} split and
{stats.get("answer_tokens")} answer tokens when this head was trained). Training used its first {data["examples"]}
answers, each after its prompt: {data["tokens"]} tokens, of which {data["answer_tokens"]} are the target's
answer tokens (the only positions with a loss). Held out: {held.get("examples")} answers of the held-out corpus
{held.get("corpus")} ({held.get("answer_tokens")} answer tokens), to prompts of conversations no trainer saw.
Labels are the target's own next-token distributions (top-8), computed once from the frozen target.
"""
    return f"""## Data

ShareGPT conversations ({data.get("file")}, sha256 `{data.get("sha256")}`): the file is cut off inside a record;
{data.get("conversations")} complete conversations were decoded record by record. Held out:
{data.get("heldout_conversations")} conversations ({data.get("heldout_rule")}), never trained on. Training used
the first {data.get("examples")} training conversations in hash order, rendered in the target's chat template and
cut at {data.get("seq_len")} tokens: {data.get("tokens")} tokens, of which {data.get("answer_tokens")} are answer
tokens (the only positions with a loss). Labels are the target's own next-token distributions (top-8), computed
once from the frozen target.
"""
