"""The one registry of speculative methods: a name -> a `Method`, the object that tells the engine, the capacity
plan, the CLI, bench and certify everything they need to know of it.

A method lives in one file: its proposer and, at the bottom, `METHOD = Method(...)`. Adding one is that file and
its line in KNOWN below (or `register(Method(...))` at run time, as tests do). Nothing outside this module and the
method's own file switches on a method's name.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdecode.errors import ConfigError

# A method's callables take a validated SpeculativeConfig (speculation/config.py) and build a Proposer
# (speculation/proposers/base.py). Both are named in words, not imported, even for type checkers: config.py looks
# methods up in this registry and every proposer file registers itself here, so an import back would close a circle.

KNOWN: dict[str, tuple[str, str]] = {
    "draft_model": ("a small model drafts", "specdecode.speculation.proposers.draft_model"),
    "ngram": ("prompt lookup", "specdecode.speculation.proposers.ngram"),
    "eagle": ("EAGLE-2 trees from a head on the target's features", "specdecode.speculation.proposers.eagle"),
    "medusa": ("Medusa heads", "specdecode.speculation.proposers.medusa"),
    "lookahead": ("Jacobi n-grams of the target itself", "specdecode.speculation.proposers.lookahead"),
    "rest": ("retrieval from a datastore", "specdecode.speculation.proposers.rest"),
    "auto": ("one tree from several sources, valued by learned acceptance", "specdecode.speculation.proposers.auto"),
    "suffix": ("a suffix tree over recent requests", "specdecode.speculation.proposers.suffix"),
}
"""name -> (what it drafts with, in a few words; the module whose METHOD describes it). Light on purpose: the
command line lists the methods without importing torch."""


@dataclasses.dataclass
class BuildContext:
    """What a method's builder may use besides its config."""

    target: Any
    """The target model (LlamaForCausalLM)."""
    tokenizer: Any
    """The target's tokenizer."""
    dtype: Any
    """The dtype the target was loaded in (name or torch.dtype)."""
    device: Any
    """The target's device."""
    target_dir: Path | None = None
    """The target's checkpoint (a directory or GGUF file), for methods that keep data beside it."""


def _k(config) -> int:
    return config.num_speculative_tokens


def _one(config) -> int:
    return 1


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculative method."""

    name: str
    """vLLM's name where vLLM has one (speculative_config["method"], --speculative-method)."""
    build: Callable[[Any, BuildContext], Any]
    """The proposer for a validated config."""
    model: str | None = None
    """What speculative_config["model"] names: "draft" (a checkpoint of a small model), "speculator" (a directory
    of heads written by `specdecode train NAME`, its config.json's "kind" = NAME), "datastore" (a directory with
    datastore.json), "draft or datastore" (either, told apart by datastore.json: auto) or None (the method needs
    none)."""
    model_required: bool = False
    """Whether the config must name a model (a shipped one is filled in for named targets first)."""
    options: tuple[str, ...] = ()
    """The speculative_config keys only this method reads."""
    max_depth: Callable[[Any], int] = _k
    """The deepest draft a step verifies (the controller's largest K)."""
    nodes_per_level: Callable[[Any], int] = _one
    """Tree nodes per drafted level (what the controller's costs are measured for)."""
    pass_nodes: Callable[[Any, int], int] | None = None
    """Nodes one sequence adds to the target pass when it drafts k levels (default nodes_per_level * k)."""
    draft_memory: str | Callable[[Any], str | None] | None = None
    """What the capacity plan counts for the proposer: "decoder" (the draft checkpoint: weights and KV cache),
    "heads" (the speculator's heads and, for EAGLE, one layer's KV cache) or None (nothing worth counting); or a
    callable of the config that says which (see memory())."""
    cache_margin: Callable[[Any], int] = lambda config: 0
    """Positions its own cache holds per row beyond the target's (drafts in flight)."""
    trainer: str | None = None
    """`specdecode train` stage that writes its model, if it learns."""
    forced_run: int = 0
    """For methods whose trees the step may rewrite (Proposer.trees_rewritable): the longest run of tokens a
    structured request's grammar forces that a step drafts (free: accepted with probability one), when longer than
    the method's own trees; the caches keep room for it."""

    def memory(self, config) -> str | None:
        """draft_memory for a config (a callable decides by what "model" names)."""
        return self.draft_memory(config) if callable(self.draft_memory) else self.draft_memory

    def nodes(self, config, k: int) -> int:
        if self.pass_nodes is not None:
            return self.pass_nodes(config, min(k, self.max_depth(config)))
        return self.nodes_per_level(config) * k


FORCED_RUN = 16
"""Method.forced_run of the methods that take one (a JSON schema's next key and its quotes fit)."""

_registered: dict[str, Method] = {}


def register(method: Method, summary: str = "") -> Method:
    """Add (or replace) a method at run time; `summary` is its --help phrase."""
    _registered[method.name] = method
    KNOWN.setdefault(method.name, (summary or method.name, ""))
    return method


def names() -> tuple[str, ...]:
    """Every method's name, in --help order."""
    return tuple(KNOWN)


def summary(name: str) -> str:
    return KNOWN[name][0]


def get(name: str) -> Method:
    """The method called name (its module is imported on first use)."""
    if name not in _registered:
        if name not in KNOWN or not KNOWN[name][1]:
            raise ConfigError(f"speculative method {name!r} is unknown; use one of {', '.join(names())}")
        method = importlib.import_module(KNOWN[name][1]).METHOD
        _registered[name] = method
    return _registered[name]
