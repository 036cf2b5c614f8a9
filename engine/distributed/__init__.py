"""Process groups for tensor parallelism: how one rank joins its group and what it may shard.

>>> parallel = init_tensor_parallel(rank=0, size=2, init_method="file:///tmp/tp-store", backend="gloo")
>>> parallel.size, parallel.rank
(2, 0)
"""
from .parallel_state import check_tensor_parallel, destroy_tensor_parallel, init_tensor_parallel

__all__ = ["init_tensor_parallel", "destroy_tensor_parallel", "check_tensor_parallel"]
