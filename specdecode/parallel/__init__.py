"""Scale-out inside one node: Megatron-style tensor parallelism of the target over torch.distributed ranks
(tp.py shards the layers, group.py carries the collectives, driver.py/worker.py run one engine over N processes,
launch.py starts them)."""
