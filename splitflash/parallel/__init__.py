"""Tensor parallelism for the target model over torch.distributed.

Applied as transforms to a built TargetModel (models/target.py stays single-device):
`shard_target` swaps each rank's linear layers for its shards, `BroadcastForward` /
`follow` keep every rank running the forward that rank 0's engine runs, and `run_tp` starts
one process per rank.
"""

from splitflash.parallel.follower import BroadcastForward, follow, pack_forward, unpack_forward
from splitflash.parallel.launch import free_port, run_tp
from splitflash.parallel.tp import (
    RowParallelLinear,
    VocabParallelLMHead,
    check_world,
    local_kv_heads,
    shard_target,
)

__all__ = [
    "BroadcastForward",
    "RowParallelLinear",
    "VocabParallelLMHead",
    "check_world",
    "follow",
    "free_port",
    "local_kv_heads",
    "pack_forward",
    "run_tp",
    "shard_target",
    "unpack_forward",
]
