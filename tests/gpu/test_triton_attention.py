"""Triton paged attention against the torch reference (SDPA over gathered slots), on random caches.

Varlen batches mixing full prefill, chunked prefill (query shorter than context) and decode, blocks
scattered over the cache, GQA groups of 1, 4 and 7, head_dim 64/128, with and without a sliding
window. Runs only where CUDA is present (the device machine); CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from loraserve.layers.attention import reference_paged_attention  # noqa: E402
from loraserve.layers.triton_attention import paged_attention  # noqa: E402
from tests.gpu.attention_batches import make_batch  # noqa: E402

DEV = torch.device("cuda")


BATCHES = {
    "decode": (
        [1] * 32,
        [int(x) for x in torch.randint(1, 300, (32,), generator=torch.Generator().manual_seed(0))],
    ),
    "prefill": ([128, 77, 1, 200], [128, 77, 1, 200]),
    "mixed": ([1, 50, 1, 17, 130], [90, 50, 300, 40, 260]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (4, 4, 64)], ids=["llama8b", "qwen05b", "mha"]
)
@pytest.mark.parametrize("window", [None, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_matches_reference(batch, heads, kv_heads, head_dim, window, dtype):
    g = torch.Generator().manual_seed(sum(map(ord, f"{batch}-{heads}-{window}")))
    q_lens, ctx_lens = BATCHES[batch]
    bs, num_blocks = 16, 600
    md = make_batch(g, q_lens, ctx_lens, bs, num_blocks, DEV)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, generator=g).to(DEV, dtype)
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(DEV, dtype)
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, md, scale, window)
    ref = reference_paged_attention(q.float(), k_cache.float(), v_cache.float(), md, scale, window)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert err < tol, f"rel err {err}"
    assert (out.float() - ref).abs().max().item() < 3 * tol


@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_fp16(batch):
    test_paged_attention_matches_reference(batch, 32, 8, 128, None, torch.float16)
