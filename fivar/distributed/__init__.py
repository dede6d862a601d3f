"""Context-parallel attention for any variant: a sequence sharded over the ranks of a torch.distributed group,
each rank getting the keys and values its queries keep step by step (`ring_attention`) or at once
(`all_gather_attention`), partial states merged by their LSEs, queries and keys at their global positions
(docs/distributed.md)."""
from .all_gather import all_gather_attention
from .ring import ring_attention
from .sharding import Sharding

__all__ = ["Sharding", "all_gather_attention", "ring_attention"]
