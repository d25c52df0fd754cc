"""The parts an engine is built from, each buildable (and testable) alone; `LLM` only wires them together."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.model.loading import load_model
from specdecode.parallel.launch import launch_tensor_parallel
from specdecode.parallel.tp import check_draft_tensor_parallel
from specdecode.plan import MemoryPlan, memory_budget_bytes, plan_memory
from specdecode.speculation.calibrate import measure_costs, pass_times
from specdecode.speculation.config import SpeculativeConfig
from specdecode.speculation.control import SpecController, best_tree_width


def plan_batch(model_dir: Path, spec_config: SpeculativeConfig | None, dtype, device: torch.device,
               max_num_seqs: int, max_model_len: int | None, tensor_parallel_size: int, quantization: str | None,
               memory_budget: int | None, gpu_memory_utilization: float | None,
               block_size: int | None = None, kv_cache_dtype: str = "auto") -> tuple[MemoryPlan | None, int]:
    """(the capacity plan, the sequences to run): without a budget, no plan and max_num_seqs as given; with one, the
    most sequences that may run at once (paged: max_num_seqs; slots: those of max_model_len that fit, at most
    max_num_seqs), refused when not even one does."""
    budget = memory_budget_bytes(device, memory_budget, gpu_memory_utilization)
    if budget is None:
        return None, max_num_seqs
    plan = plan_memory(model_dir, budget, max_model_len, max_num_seqs, spec_config, dtype, device,
                       tensor_parallel_size, quantization=quantization, block_size=block_size,
                       kv_cache_dtype=kv_cache_dtype)
    if plan.largest_batch() < 1:
        raise ConfigError(plan.refusal())
    return plan, min(max_num_seqs, plan.largest_batch())


def load_target(model_dir: Path, dtype, device: torch.device, quantization: str | None,
                tensor_parallel_size: int = 1, draft_tensor_parallel_size: int | None = None):
    """The target model: loaded here, or sharded over tensor_parallel_size processes (this one is rank 0)."""
    check_draft_tensor_parallel(draft_tensor_parallel_size)
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1:
        return launch_tensor_parallel(model_dir, tensor_parallel_size, dtype, device, quantization)
    return load_model(model_dir, dtype=dtype, device=device, quantization=quantization)


def fit_tree_width(target, proposer, config: SpeculativeConfig) -> SpeculativeConfig:
    """For a proposer whose trees may take any number of nodes per level (eagle, medusa) and a config that leaves it free
    (no num_tree_nodes), the width that pays best on this machine: one-row target passes of the candidate shapes
    and the speculator's drafting levels are timed (~2 s), and the speculator's held-out accuracies give the
    expected tokens (control.best_tree_width). Returns the config with that tree (num_tree_nodes) and sets the
    proposer's width; any other config is returned as it is. On SmolLM2 on a 2-core CPU a 4-node level costs
    about 1.8 plain steps to verify and a 1-node one 1.05, so the shipped EAGLE head (34% depth-1 acceptance)
    pays only as a chain."""
    accuracy = getattr(proposer, "rank_accuracy", None)
    if config.num_tree_nodes is not None or accuracy is None:
        return config
    widest, depth = config.nodes_per_level, config.max_depth
    candidates = sorted({n for n in (1, 2, widest) if n <= widest})
    passes = pass_times(target, [1] + [1 + n * k for n in candidates for k in range(1, depth + 1)])
    network = proposer.draft_network  # None: drafting runs no network per level (Medusa's heads run once a step)
    levels = (pass_times(network, candidates, budget_seconds=1.0) if network is not None
              else dict.fromkeys(candidates, 0.0))
    nodes, _ = best_tree_width(passes, levels, accuracy, depth, candidates)
    proposer.set_nodes_per_level(nodes)
    return dataclasses.replace(config, num_tree_nodes=nodes * config.num_speculative_tokens)


def make_controller(target, proposer, config: SpeculativeConfig, max_num_seqs: int,
                    stored_as: str | None = None) -> SpecController:
    """An adaptive speculation controller, after timing this machine's target passes and draft forwards (or reading
    the times kept under `stored_as`, calibrate.py's measure_costs)."""
    costs = measure_costs(target, proposer.draft_network, max_num_seqs, config.max_depth, config.nodes_per_level,
                          widths=config.pass_widths, stored_as=stored_as)
    controller = SpecController(costs, config.max_depth, config.nodes_per_level, widths=config.pass_widths)
    if hasattr(proposer, "bind_costs"):  # a proposer that shapes its trees by the measured pass costs (auto)
        proposer.bind_costs(costs)
        controller.delegated = True
    return controller
