"""Flash Attention's varlen forward (``kernels.varlen_attention`` on CUDA) against its torch twin, in bf16, at
DeepSeek's widths (a 192-wide query and key, 128-wide values padded to it) and a square 128: engine padding
sequences (empty) and padding tokens past the last sequence included.  Skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from mla_fuser.kernels.varlen_attention import (  # noqa: E402
    varlen_causal_attention,
    varlen_causal_attention_ref,
    varlen_causal_supported,
)


@pytest.mark.parametrize("qk, v_dim", [(192, 128), (128, 128)])
def test_flash_varlen_equals_twin_bf16(qk, v_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 0, 1, 130, 5, 0, 64]
    total, pad = sum(lengths), 6
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k = (torch.randn(total + pad, 16, qk, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(total + pad, 16, v_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = qk ** -0.5
    assert varlen_causal_supported(q, v_dim)
    got = varlen_causal_attention(q, k, v, cu, total + pad, scale)
    want = varlen_causal_attention_ref(q.float(), k.float(), v.float(), cu, scale)
    assert got.shape == (total + pad, 16, v_dim) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[:total].float(), want[:total], rtol=2e-2, atol=2e-2)


def test_unsupported_shapes_refused():
    q = torch.randn(4, 2, 320, device="cuda", dtype=torch.bfloat16)  # wider than Flash Attention's 256
    assert not varlen_causal_supported(q, 128)
    assert not varlen_causal_supported(q[..., :192].float(), 128)  # float32: not Flash Attention's
    with pytest.raises(ValueError, match="cannot take"):
        varlen_causal_attention(q, q, q[..., :128], torch.tensor([0, 4], dtype=torch.int32, device="cuda"), 4, 0.1)
