"""`llmc::attention` reference: per-row positions in a preallocated cache, causal, MHA/GQA/MQA."""

import pytest
import torch
import torch.nn.functional as F

from llmc.plugins.op.attention import attention, reference_attention


def naive(query, key, value, k_cache, v_cache, cache_position, scale):
    """Row by row with SDPA over the row's own history: an independent statement of the semantics."""
    out = torch.empty_like(query)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    s, h, kvh = query.shape[1], query.shape[2], key.shape[2]
    for b, p in enumerate(cache_position.tolist()):
        k_cache[b, :, p:p + s] = key[b].transpose(0, 1)
        v_cache[b, :, p:p + s] = value[b].transpose(0, 1)
        k = k_cache[b, :, :p + s].repeat_interleave(h // kvh, 0)
        v = v_cache[b, :, :p + s].repeat_interleave(h // kvh, 0)
        q = query[b].transpose(0, 1)  # [H, S, D]
        mask = torch.arange(p + s)[None, :] <= (p + torch.arange(s))[:, None]
        out[b] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out, k_cache, v_cache


def random_case(batch, seq, heads, kv_heads, capacity, positions, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=g)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    kc = torch.randn(batch, kv_heads, capacity, head_dim, generator=g)  # stale data everywhere
    vc = torch.randn(batch, kv_heads, capacity, head_dim, generator=g)
    return q, k, v, kc, vc, torch.tensor(positions, dtype=torch.int64), head_dim ** -0.5


CASES = {
    "mha-prefill": (1, 7, 4, 4, 16, [0]),
    "gqa3-decode-mixed": (3, 1, 9, 3, 32, [0, 5, 30]),
    "gqa8-chunk": (2, 5, 8, 1, 24, [3, 19]),  # MQA, a chunk continuing a cached prefix
    "gqa2-odd": (4, 3, 6, 3, 13, [0, 1, 7, 10]),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_naive_per_row_sdpa(name):
    args = random_case(*CASES[name])
    got = attention(*args)
    want = naive(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_only_the_new_positions_are_written():
    q, k, v, kc, vc, pos, scale = random_case(2, 2, 4, 2, 10, [3, 6])
    _, k_out, v_out = attention(q, k, v, kc, vc, pos, scale)
    written = torch.zeros(2, 10, dtype=torch.bool)
    written[0, 3:5] = written[1, 6:8] = True
    assert torch.equal(k_out[:, :, ~written[0]][0], kc[0][:, ~written[0]])
    assert torch.equal(k_out[1][:, ~written[1]], kc[1][:, ~written[1]])
    assert torch.equal(v_out[0, :, 3:5], v[0].transpose(0, 1))
    assert not torch.equal(kc, k_out)  # functional: the input cache is not modified in place


def test_data_beyond_a_rows_position_is_never_read():
    q, k, v, kc, vc, pos, scale = random_case(2, 1, 4, 2, 12, [4, 9])
    out_a = attention(q, k, v, kc, vc, pos, scale)[0]
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[0, :, 5:] = 1e4  # garbage after row 0's new token
    vc2[1, :, 10:] = -1e4
    torch.testing.assert_close(attention(q, k, v, kc2, vc2, pos, scale)[0], out_a)


def test_decode_steps_equal_one_prefill():
    """Feeding tokens one at a time through the cache gives the prefill's outputs."""
    q, k, v, kc, vc, _, scale = random_case(1, 6, 6, 2, 8, [0])
    full, k_full, _ = attention(q, k, v, kc, vc, torch.tensor([0]), scale)
    for i in range(6):
        step, kc, vc = attention(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], kc, vc, torch.tensor([i]), scale)
        torch.testing.assert_close(step[:, 0], full[:, i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc[:, :, :6], k_full[:, :, :6])


def test_half_precision_accumulates_in_float():
    args = random_case(2, 3, 4, 2, 8, [0, 4])
    half = [a.half() if a.is_floating_point() else a for a in args[:6]] + [args[6]]
    got = attention(*half)[0]
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), reference_attention(*args)[0], rtol=2e-2, atol=2e-2)


def test_overflowing_the_cache_is_an_error():
    with pytest.raises(ValueError, match="KV cache overflow: position 8 does not fit capacity 8"):
        attention(*random_case(1, 2, 2, 2, 8, [7]))


def test_registered_op_passes_opcheck():
    torch.library.opcheck(torch.ops.llmc.attention.default, random_case(2, 3, 4, 2, 8, [0, 4]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_op_survives_torch_export():
    class Wrap(torch.nn.Module):
        def forward(self, q, k, v, kc, vc, pos):
            return torch.ops.llmc.attention(q, k, v, kc, vc, pos, 0.5)

    args = random_case(2, 1, 4, 2, 8, [2, 5])[:6]
    program = torch.export.export(Wrap(), args)
    assert any(n.target is torch.ops.llmc.attention.default for n in program.graph.nodes)
    torch.testing.assert_close(program.module()(*args)[0], Wrap()(*args)[0])


def test_rotary_tables_rotate_new_queries_and_keys_at_their_positions():
    """With cos/sin tables the op equals rotating q and k first (rotate-half RoPE) and calling it without."""
    q, k, v, kc, vc, pos, scale = random_case(3, 2, 6, 2, 16, [0, 4, 11])
    d = q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(16).float()[:, None] * inv_freq  # [P, D/2]
    cos, sin = angles.cos(), angles.sin()
    positions = pos[:, None] + torch.arange(2)
    full_cos = torch.cat([cos[positions]] * 2, -1)[:, :, None]
    full_sin = torch.cat([sin[positions]] * 2, -1)[:, :, None]

    def rope(x):
        return x * full_cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * full_sin

    expected = naive(rope(q), rope(k), v, kc, vc, pos, scale)
    got = attention(q, k, v, kc, vc, pos, scale, cos, sin)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
