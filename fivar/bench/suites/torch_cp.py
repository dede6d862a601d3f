"""PyTorch's own context parallelism as a contender of the context-parallel suite: FlexAttention with a variant's
score_mod and mask_mod under torch.distributed's `_ContextParallel`, on the zigzag (head-tail) layout fivar's
balanced sharding also uses where the mask leaves zigzag even."""
from __future__ import annotations

TORCH_CP = "torch-cp"  # the contender's name in the context-parallel suite


def torch_cp_attention(variant, params: dict, sharding, heads: tuple, head_dim: int, device):
    """PyTorch's own context parallelism: a callable (q, k, v) -> (out, lse) of this rank's zigzag shard ([rows,
    heads, dim]; lse in log2, as fivar's), collective when called. It is flex_attention inside a module under
    torch.distributed.tensor.experimental's `_ContextParallel` (AttentionType.FLEX: a forward pre-hook all-gathers
    K and V, their gradients reduce-scattered), with the variant's score_mod and mask_mod (fivar.flex) as the local
    BlockMask `_create_cp_block_mask` makes for PyTorch's head-tail load balancer, which is the zigzag sharding.
    Built once (the block mask is compiled here), every rank alike."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (_ContextParallel,
                                                                                     _create_cp_block_mask)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, AuxRequest, flex_attention

    from ...errors import FivarError
    from ...flex import flex_mods
    from ...spec import ir
    from ...spec.inputs import LOG2E
    S, world, rank = sharding.seq_len, sharding.world_size, dist.get_rank()
    (hq, hkv), vir = heads, variant.ir
    if S % (world * _DEFAULT_SPARSE_BLOCK_SIZE):
        raise FivarError(f"{TORCH_CP}: PyTorch's CP block mask needs the sequence ({S}) to be a multiple of "
                         f"{world} ranks x {_DEFAULT_SPARSE_BLOCK_SIZE}")
    if vir.logits is not None and {"q_idx", "kv_idx"} & ir.uses(vir.logits):
        # _ContextParallel rewrites the mask_mod to global positions, never the score_mod
        raise FivarError(f"{TORCH_CP}: variant '{variant.name}': its logits read positions, and PyTorch's CP hands "
                         f"the score_mod local ones")
    balancer = _HeadTailLoadBalancer(S, world, device)
    theirs = balancer._generate_indices()[0].view(world, -1)[rank].cpu().long()
    ours = torch.cat([torch.arange(s, e) for s, e in sharding.runs[rank]])
    if not torch.equal(theirs, ours):
        raise FivarError(f"{TORCH_CP}: PyTorch's head-tail layout is not the sharding's on rank {rank}")
    sm_scale = 1.0 / math.sqrt(head_dim)
    score_mod, mask_mod = flex_mods(variant, params, qo_len=S, kv_len=S, num_qo_heads=hq, num_kv_heads=hkv,
                                    sm_scale=sm_scale, causal=True, device=device)
    per_head = vir.mask is not None and bool({"qo_head", "kv_head"} & ir.uses(vir.mask))
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    block_mask = _create_cp_block_mask(mask_mod, 1, hq if per_head else 1, S, S, mesh, load_balancer=balancer)
    # compiled on GPUs (eager Flex materialises the scores); eager on CPUs (the unit test's tiny shapes)
    fa = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    class Flex(torch.nn.Module):
        def forward(self, q, k, v):
            return fa(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=hq != hkv,
                      return_aux=AuxRequest(lse=True))
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    module = parallelize_module(Flex(), mesh, style)

    def run(q, k, v):
        out, aux = module(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))  # [1, heads, rows, dim]
        return out.squeeze(0).transpose(0, 1), aux.lse.squeeze(0).transpose(0, 1) * LOG2E
    return run
