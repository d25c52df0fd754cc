"""Deliberately wrong verifiers, each a small edit of the real one, for showing that certify has power: injected where
the step verifies (specdecode.speculation.verify's verify_chains and verify_trees for rejection sampling,
race_positions and race_tokens for the race) with monkeypatch.setattr."""
from __future__ import annotations

import dataclasses

import torch

import specdecode.speculation.verify as verify_module
from specdecode.sampling import sample_from, sample_rows
from specdecode.speculation.verify import VerifyResult, verify_chains, verify_sampling


def chains_correction_from_p(p, q, tokens, lengths, u_accept, u_draw):
    """The chain rule, but a rejected position is drawn from p instead of norm(max(0, p - q))."""
    n_matches, _ = verify_chains(p, q, tokens, lengths, u_accept, u_draw)
    rows = torch.arange(len(tokens), device=p.device)
    return n_matches, sample_rows(p[rows, n_matches], u_draw[rows, n_matches])


def tree_correction_from_p(tree, p_all, uniforms):
    """The tree rule, but when every child is rejected the token is drawn from p instead of what is left of p."""
    result = verify_sampling(tree, p_all, uniforms)
    node = result.accepted[-1] if result.accepted else -1
    if tree.shape.children[node + 1]:
        return VerifyResult(result.accepted, sample_from(p_all[node + 1], uniforms.draw(len(result.accepted))))
    return result


def q_at_temperature(q: torch.Tensor, ratio: float) -> torch.Tensor:
    """The draft's distribution as if computed at temperature T / ratio when it was drawn at T: q^ratio, normalised
    (exact without top-k/top-p)."""
    q = q.double().pow(ratio)
    return (q / q.sum(-1, keepdim=True)).to(torch.float32)


def chains_q_other_temperature(ratio: float = 0.5):
    """The chain rule with q from another temperature than the drafts were drawn with."""
    def verify(p, q, tokens, lengths, u_accept, u_draw):
        return verify_chains(p, None if q is None else q_at_temperature(q, ratio), tokens, lengths, u_accept, u_draw)
    return verify


def tree_q_other_temperature(ratio: float = 0.5):
    def verify(tree, p_all, uniforms):
        if tree.draft_probs is not None:
            tree = dataclasses.replace(tree, draft_probs=q_at_temperature(tree.draft_probs, ratio))
        return verify_sampling(tree, p_all, uniforms)
    return verify


def tree_siblings_unnormalised(tree, p_all, uniforms):
    """The multi-draft rule, but after a rejected child the next sibling is tried against max(0, p - q) without
    renormalising it (the final draw is still from what is left, normalised)."""
    children = tree.shape.children
    tokens = tree.tokens.tolist()
    q_all = tree.draft_probs
    accepted, node = [], -1
    while True:
        p = p_all[node + 1]
        depth = len(accepted)
        for tried, child in enumerate(children[node + 1]):
            x = tokens[child]
            q_x = 1.0 if q_all is None else float(q_all[child, x])
            if uniforms.accept(depth, tried) * q_x < float(p[x]):
                accepted.append(child)
                node = child
                break
            if q_all is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q_all[child]).clamp(min=0.0)  # the bug: no division by the residual's mass
        else:
            left = p if float(p.sum()) > 0 else p_all[node + 1]
            return VerifyResult(accepted, sample_from(left, uniforms.draw(depth)))


def race_positions_off_by_one(tree, start):
    """The race, but the target's token after a node at depth d takes the noise of position start + d (the one the
    node itself won) instead of start + d + 1: after an accepted draft, two positions share one race's noise."""
    return [start] + (tree.depths + start).tolist()


def race_uniform_noise(probs, keys, positions):
    """The race, but each token's clock is the uniform u itself rather than the exponential -log(1 - u)."""
    from specdecode.sampling import race_uniforms

    u = race_uniforms(keys, positions, torch.arange(probs.shape[1]).expand(probs.shape))
    return (probs.double() / u).masked_fill(~(probs > 0), -1.0).argmax(-1)


def probs_without_min_p(logits, temperature, top_k, top_p, min_p=None):
    """The verifier's target distribution computed without min_p (as when a speculative path drops it)."""
    from specdecode.sampling import processed_probs

    return processed_probs(logits, temperature, top_k, top_p)


def penalties_from_root(logits, params, prompt_ids, output_ids, paths):
    """Penalties computed from the root's prefix for every tree node: the drafted path before a node is ignored."""
    from specdecode.sampling import penalize

    return penalize(logits, params, prompt_ids, output_ids, [[] for _ in paths])


def grammar_mask_from_root(real):
    """The grammar's mask of the root used at every tree node (the drafted path before a node ignored)."""
    def tree_masks(self, paths):
        masks = real(self, [[]])
        return masks.expand(len(paths), -1)
    return tree_masks


BROKEN = {
    "correction_from_p": {"verify_chains": chains_correction_from_p, "verify_sampling": tree_correction_from_p},
    "q_other_temperature": {"verify_chains": chains_q_other_temperature(), "verify_sampling": tree_q_other_temperature()},
    "siblings_unnormalised": {"verify_sampling": tree_siblings_unnormalised},
    "race_off_by_one": {"race_positions": race_positions_off_by_one},
    "race_uniform_noise": {"race_tokens": race_uniform_noise},
    "min_p_dropped": {"processed_probs": probs_without_min_p},
    "penalties_from_root": {"penalize": penalties_from_root},
    "grammar_from_root": {"tree_masks": None},
}
"""Name -> the verifier functions to replace (verify_sampling: the rule for each sampled tree)."""


def inject(monkeypatch, name: str) -> None:
    from tests.speculation.heads_fixtures import per_tree

    for attr, fn in BROKEN[name].items():
        if attr == "tree_masks":  # in the step only: certify's reference keeps the real masks
            import specdecode.engine.step as step_module
            from specdecode.speculation.grammar import Grammar

            class RootMasked(Grammar):
                tree_masks = grammar_mask_from_root(Grammar.tree_masks)

                def consume(self, tokens):  # tokens the real grammar forbids (from a node's wrong mask) are skipped
                    for token in tokens:
                        self.matcher.try_consume_tokens([token])
            real_init = step_module.StepRunner._adjusted_logits

            def penalized(seqs, logits, trees):
                for seq in seqs:
                    if seq.grammar is not None and type(seq.grammar) is Grammar:
                        seq.grammar.__class__ = RootMasked
                return real_init(seqs, logits, trees)
            monkeypatch.setattr(step_module.StepRunner, "_adjusted_logits", staticmethod(penalized))
        elif attr == "penalize":  # where the step applies them (certify's reference keeps the real one)
            import specdecode.engine.step as step_module

            monkeypatch.setattr(step_module, "penalize", fn)
        elif attr == "verify_sampling":  # a per-tree rule, where the step verifies every tree at once
            monkeypatch.setattr(verify_module, "verify_trees", per_tree(fn))
        else:
            monkeypatch.setattr(verify_module, attr, fn)
