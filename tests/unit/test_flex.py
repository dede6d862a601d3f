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


def test_sigmoid_has_no_flex_equivalent():
    v = fivar.load("sigmoid")
    with pytest.raises(fivar.FivarError, match="no Flex equivalent"):
        flex_attention_fn(v, {}, torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16))
