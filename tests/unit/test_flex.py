"""FlexAttention running the variant (CPU, eager) matches fivar's torch reference."""
import pytest
import torch

import fivar
from fivar.flex import flex_attention_fn
from fivar.testing import example_params

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("name", ["softcap", "alibi", "sliding_window", "document_mask", "relative_bias",
                                  "softcap_sliding_window"])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_matches_reference(name, causal):
    v = fivar.load(name)
    q, k, vv = torch.randn(40, 4, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    params = example_params(v, num_qo_heads=4, num_kv_heads=2, batch_size=1, max_len=64, device="cpu")
    try:
        out = flex_attention_fn(v, params, q, k, vv, causal=causal, compile=False)()
    except Exception as e:  # flex's eager CPU path is not available in every torch build
        pytest.skip(f"FlexAttention eager on CPU unavailable: {type(e).__name__}: {e}")
    ref = v.reference(q, k, vv, causal=causal, **params)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def test_flex_per_head_mask_matches_reference():
    """A mask reading the head (a window per head) gets a block mask per head, not head 0's for all."""
    from fivar import AttentionVariant, Tensor

    def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return q_idx - kv_idx < params.windows[qo_head]

    v = AttentionVariant(name="flex_per_head_window", mask=mask, params={"windows": Tensor("int32", ("qo_head",))})
    q, k, vv = torch.randn(400, 4, 16), torch.randn(400, 2, 16), torch.randn(400, 2, 16)  # several 128-key blocks
    params = {"windows": torch.tensor([1, 3, 150, 1 << 30], dtype=torch.int32)}  # head 0 keeps least
    from fivar.flex import flex_block_mask, flex_mods
    # compiled Flex visits only the blocks its block mask keeps: each head's must hold all that head keeps
    _, mask_mod = flex_mods(v, params, qo_len=400, kv_len=400, num_qo_heads=4, num_kv_heads=2, sm_scale=0.25,
                            causal=True, device="cpu")
    blocks = flex_block_mask(v, mask_mod, 400, 400, 4, "cpu").to_dense()[0]
    keep = torch.stack([mask_mod(0, torch.tensor(h), torch.arange(400)[:, None], torch.arange(400)[None, :])
                        for h in range(4)])
    needed = torch.nn.functional.pad(keep.float(), (0, 112, 0, 112)).view(4, 4, 128, 4, 128).amax((2, 4)) > 0
    assert bool((blocks.bool() | ~needed).all())
    try:
        out = flex_attention_fn(v, params, q, k, vv, causal=True, compile=False)()
    except Exception as e:  # flex's eager CPU path is not available in every torch build
        pytest.skip(f"FlexAttention eager on CPU unavailable: {type(e).__name__}: {e}")
    torch.testing.assert_close(out, v.reference(q, k, vv, causal=True, **params), rtol=2e-4, atol=2e-4)


def test_sigmoid_has_no_flex_equivalent():
    v = fivar.load("sigmoid")
    with pytest.raises(fivar.FivarError, match="no Flex equivalent"):
        flex_attention_fn(v, {}, torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16))


def _bucketed(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    n = abs(kv_idx - q_idx)
    far = 4 + int(fivar.log(float(fivar.maximum(n, 1)) / 4.0) / fivar.log(32.0 / 4.0) * 4.0)
    bucket = fivar.where(kv_idx > q_idx, 8, 0) + fivar.where(n < 4, n, fivar.minimum(far, 7))
    return score + params.table[qo_head, bucket]


def test_compiled_flex_takes_constants_of_the_logits():
    """Compiled Flex (Inductor lowers the score_mod) on a logits function full of constants (T5-style buckets):
    the evaluator's constants must be ops Inductor can lower inside Flex's kernel, not lifted tensor constants."""
    from fivar import AttentionVariant, Tensor
    v = AttentionVariant(name="flex_buckets", logits=_bucketed,
                         params={"table": Tensor("float32", ("qo_head", "buckets"))})
    gen = torch.Generator().manual_seed(0)
    q, k, vv = (torch.randn(128, h, 16, generator=gen) for h in (4, 2, 2))
    params = {"table": torch.randn(4, 16, generator=gen)}
    try:
        out = flex_attention_fn(v, params, q, k, vv, causal=True, compile=True)()
    except Exception as e:  # noqa: BLE001
        if "LoweringException" in type(e).__name__ + str(e):
            raise
        pytest.skip(f"compiled FlexAttention on CPU unavailable: {type(e).__name__}: {str(e)[:200]}")
    torch.testing.assert_close(out, v.reference(q, k, vv, causal=True, **params), rtol=2e-4, atol=2e-4)
