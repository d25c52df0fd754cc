"""Speculator heads for the tests (trained for a few seconds on a tiny target's own text, or built to copy a target
that is in effect one layer deep, so that they are accepted often; or left random), saved as speculator
directories; chi-square runs and a wrong verifier for negative controls."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.model.loading import load_model, save_model
from specdecode.speculation.heads import EagleHead, HeadConfig, MedusaHeads, save_head
from specdecode.speculation.tree import DraftTree
from specdecode.speculation.verify import VerifyResult, verify_sampling
from specdecode.model.digest import weights_digest

from . import test_lossless_sampling as lossless


def target_text(target, prompts: int, length: int, seed: int = 0, sample: bool = False) -> torch.Tensor:
    """[prompts, length] token ids: a few random tokens, then the target's greedy (or sampled) continuation."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (prompts, 4), generator=gen)
    with torch.no_grad():
        while ids.shape[1] < length:
            logits = target(ids).logits[:, -1]  # [N, V]
            next_ids = torch.multinomial(logits.softmax(-1), 1, generator=gen) if sample else logits.argmax(-1, True)
            ids = torch.cat([ids, next_ids], dim=1)
    return ids


def train_medusa(target, draft_to_target: torch.Tensor, text: torch.Tensor, num_heads: int,
                 steps: int = 150) -> MedusaHeads:
    """Head i at t learns the target's greedy token t + 2 + i from the normed hidden state at t."""
    torch.manual_seed(0)
    heads = MedusaHeads(target, draft_to_target, num_heads)
    with torch.no_grad():
        out = target(text)
    hidden, labels = out.hidden, out.logits.argmax(-1)  # [N, T, D], [N, T]
    to_draft = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_to_target] = torch.arange(len(draft_to_target))
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for i, block in enumerate(heads.blocks):
            logits = heads.lm_head(block(hidden[:, :-1 - i]))  # predicts the token after position t + 1 + i
            loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          to_draft[labels[:, 1 + i:]].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


def save_speculator(head, target, folder: Path, **extra) -> Path:
    """Write a speculator directory for `target` (its config gets `extra` keys, e.g. topk_accuracy)."""
    kind = "eagle" if isinstance(head, EagleHead) else "medusa"
    num_heads = len(head.blocks) if kind == "medusa" else 1
    save_head(head, HeadConfig(kind, weights_digest(target), len(head.draft_to_target), num_heads), folder,
              f"# test {kind} head\n")
    if extra:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return Path(folder)


def load_target(model_dir: Path):
    """The target in float32, frozen (EagleHead shares its embedding)."""
    return load_model(model_dir, dtype=torch.float32, device="cpu").requires_grad_(False)


def copy_head(target, draft_to_target: torch.Tensor) -> EagleHead:
    """For a target whose layers but the last pass their input through (see keep_last_layer): a head that is the
    target itself, by construction (fc passes the token's embedding through, the decoder layer is the target's
    last), so its guesses are the target's own, but for the attention to the first token, which the head's cache
    has no entry for."""
    head = EagleHead(target, draft_to_target)
    d = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
        head.fc.bias.zero_()
        head.decoder.model.layers[0].load_state_dict(target.model.layers[-1].state_dict())
    return head.eval()


def keep_last_layer(model_dir: Path) -> None:
    """Rewrite a checkpoint so that every decoder layer but the last adds nothing to the residual stream."""
    model = load_target(model_dir)
    with torch.no_grad():
        for layer in model.model.layers[:-1]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save_model(model, model_dir, dtype=torch.float32)


def correction_from_p(tree, p_all, uniforms, generator=torch.Generator().manual_seed(0)):
    """A wrong tree verifier: decides like the real rule, but when every child of a node is rejected, draws from p
    instead of what is left of p (so a rejected guess can come back)."""
    result = verify_sampling(tree, p_all, uniforms)
    node = result.accepted[-1] if result.accepted else -1
    if tree.shape.children[node + 1]:
        token = int(torch.multinomial(p_all[node + 1].float(), 1, generator=generator))
        return VerifyResult(result.accepted, token)
    return result


def chi_square_p(root: Path, config: dict, params, monkeypatch, samples: int = 8000):
    """(p-value of the chi-square test that speculative samples of the first three tokens follow the target in
    root / "target", the run's SpecStats), with `samples` requests (the suite's default is 20,000; the negative
    controls show that 8,000 are enough)."""
    monkeypatch.setattr(lossless, "SAMPLES", samples)
    target_dir = root / "target"
    drawn, llm, _ = lossless.speculative_samples(target_dir, config, params)
    return lossless.goodness_of_fit(lossless.exact_distribution(target_dir, params), drawn), llm.total_stats


class TableUniforms:
    """StepUniforms' interface over the verifier's tables: accept(depth, child) = u_accept[depth, child]."""

    def __init__(self, u_accept: torch.Tensor, u_draw: torch.Tensor):
        self.u_accept, self.u_draw = u_accept, u_draw

    def accept(self, depth: int, child: int) -> float:
        return float(self.u_accept[depth, child])

    def draw(self, depth: int) -> float:
        return float(self.u_draw[depth])


def per_tree(verify_one):
    """verify_trees' signature over a verifier of one tree (tree, p_all, uniforms) - to inject a wrong rule where
    the step verifies its sampled trees (monkeypatch specdecode.speculation.verify.verify_trees)."""
    def verify(p, q, tokens, children, u_accept, u_draw):
        B, D = u_draw.shape
        accepted = torch.full((B, D), -1, dtype=torch.long)
        next_token = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            parents = {}
            for node, kids in enumerate(children[b].tolist()):
                for child in kids:
                    if child >= 0:
                        parents[child] = node - 1
            n = len(parents)
            tree = DraftTree(tokens=tokens[b, :n].cpu(), parents=tuple(parents[i] for i in range(n)),
                             draft_probs=None if q is None else q[b, :n].cpu())
            result = verify_one(tree, p[b, :n + 1].cpu(), TableUniforms(u_accept[b], u_draw[b]))
            accepted[b, :len(result.accepted)] = torch.tensor(result.accepted, dtype=torch.long)
            next_token[b] = result.next_token
        return accepted.to(p.device), next_token.to(p.device)
    return verify


def chains_by(verify_one):
    """verify_chains' signature over a verifier of one tree, so that sampled chains take that rule too (monkeypatch
    specdecode.speculation.verify.verify_chains)."""
    def verify(p, q, tokens, lengths, u_accept, u_draw):
        B = len(tokens)
        n_matches = torch.zeros(B, dtype=torch.long)
        next_token = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            n = int(lengths[b])
            tree = DraftTree.chain(tokens[b, :n].cpu(), None if q is None else q[b, :n].cpu())
            result = verify_one(tree, p[b, :n + 1].cpu(), TableUniforms(u_accept[b][:, None], u_draw[b]))
            n_matches[b], next_token[b] = len(result.accepted), result.next_token
        return n_matches.to(p.device), next_token.to(p.device)
    return verify


def node_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """The token path from the root to every node of a tree given as tokens and a parent array."""
    paths = set()
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        paths.add(tuple(path[::-1]))
    return paths
