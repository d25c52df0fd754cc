"""The parts an engine is built from, each buildable (and testable) alone; `LLM` only wires them together."""
from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.model.loading import load_model
from specdecode.parallel.launch import launch_tensor_parallel
from specdecode.parallel.tp import check_draft_tensor_parallel
from specdecode.plan import MemoryPlan, memory_budget_bytes, plan_memory
from specdecode.speculation.calibrate import measure_costs
from specdecode.speculation.config import SpeculativeConfig
from specdecode.speculation.control import SpecController


def plan_batch(model_dir: Path, spec_config: SpeculativeConfig | None, dtype, device: torch.device,
               max_num_seqs: int, max_model_len: int | None, tensor_parallel_size: int, quantization: str | None,
               memory_budget: int | None, gpu_memory_utilization: float | None) -> tuple[MemoryPlan | None, int]:
    """(the capacity plan, the sequences to run): without a budget, no plan and max_num_seqs as given; with one, the
    most sequences of max_model_len that fit (at most max_num_seqs), refused when not even one does."""
    budget = memory_budget_bytes(device, memory_budget, gpu_memory_utilization)
    if budget is None:
        return None, max_num_seqs
    plan = plan_memory(model_dir, budget, max_model_len, max_num_seqs, spec_config, dtype, device,
                       tensor_parallel_size, quantization=quantization)
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


def make_controller(target, proposer, config: SpeculativeConfig, max_num_seqs: int) -> SpecController:
    """An adaptive speculation controller, after timing this machine's target passes and draft forwards."""
    costs = measure_costs(target, proposer.draft_network, max_num_seqs, config.max_depth, config.nodes_per_level,
                          widths=config.pass_widths)
    controller = SpecController(costs, config.max_depth, config.nodes_per_level, widths=config.pass_widths)
    if hasattr(proposer, "bind_costs"):  # a proposer that shapes its trees by the measured pass costs (auto)
        proposer.bind_costs(costs)
        controller.delegated = True
    return controller
