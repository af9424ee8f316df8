"""kprof.kernels.rope against its reference and against transformers' apply_rotary_pos_emb.

Shapes cross the kernel's regimes: a single head/position, GQA (Hq != Hk), head counts that
are not powers of two, a half-dim that is not a power of two (D=6), half-dims wider than one
block (D=1024 loops over 4 blocks of 128; D=65536 over 256: on the CPU only once, in
test_huge_head_dim, as the interpreter needs seconds per call), and the Llama/benchmark shapes
(GPU only; the interpreter would take minutes). Partial rotary (cos/sin R < D wide, GPT-NeoX) and
the interleaved form (torchtitan's pairs (2i, 2i + 1)) have their own shapes: R not a power of
two, D = 96, pass-throughs over several copy blocks, half-dims over several blocks.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import KprofError
from kprof.kernels import registry
from kprof.kernels.common import assert_close
from kprof.kernels.rope import SPEC, apply_rope, apply_rope_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp16 where fp32 and bf16 already cover the code path: slow (docs/testing.md)
DTYPE_CASES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # for hypothesis tests (no fixtures there)
gpu = pytest.mark.gpu

# (B, Hq, Hk, S, D)
SHAPES = [
    (1, 1, 1, 1, 2),
    (2, 4, 2, 5, 8),
    (3, 7, 1, 9, 6),
    (1, 2, 2, 3, 1024),
    pytest.param((1, 1, 1, 1, 65536), marks=gpu),  # on the CPU: test_huge_head_dim, once
    pytest.param((2, 32, 8, 64, 128), marks=gpu),
    pytest.param((8, 32, 32, 2048, 128), marks=gpu),  # the benchmark shape
    pytest.param((1, 40, 8, 333, 256), marks=gpu),
]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype == torch.float32 else torch.float32)


def _make(shape, dtype, device, unsqueeze_dim=1, cos_batch=None, hf_tables=False, seed=0, rot_dim=None):
    """q, k in the layout of `unsqueeze_dim`, and cos/sin [cos_batch or B, S, rot_dim or D]."""
    b, hq, hk, s, head_dim = shape
    d = rot_dim or head_dim
    g = torch.Generator().manual_seed(seed)
    qs, ks = (((b, hq, s, head_dim), (b, hk, s, head_dim)) if unsqueeze_dim == 1
              else ((b, s, hq, head_dim), (b, s, hk, head_dim)))
    q = torch.randn(qs, generator=g).to(device, dtype)
    k = torch.randn(ks, generator=g).to(device, dtype)
    cb = b if cos_batch is None else cos_batch
    if hf_tables:  # what HF's rotary embedding builds: both halves equal
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
        pos = torch.arange(s).double()[None, :, None] + torch.arange(cb).double()[:, None, None]
        emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)
        cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    else:  # arbitrary tables (halves differ): checks the general formula and its transpose
        cos = torch.randn(cb, s, d, generator=g).to(device, dtype)
        sin = torch.randn(cb, s, d, generator=g).to(device, dtype)
    return q, k, cos, sin


def _check(q, k, cos, sin, unsqueeze_dim=1, **kw):
    """Forward and backward of the kernel vs the upcast reference; returns the outputs."""
    q = q.detach().requires_grad_()  # detach keeps strides
    k = k.detach().requires_grad_()
    q_in, k_in = q.detach().clone(), k.detach().clone()
    qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, **kw)
    dqo, dko = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (dqo, dko))
    qr, kr = _upcast(q.detach()).requires_grad_(), _upcast(k.detach()).requires_grad_()
    qro, kro = apply_rope_reference(qr, kr, _upcast(cos), _upcast(sin), unsqueeze_dim=unsqueeze_dim, **kw)
    torch.autograd.backward((qro, kro), (_upcast(dqo), _upcast(dko)))
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    assert qo.shape == q.shape and ko.shape == k.shape
    assert qo.dtype == out_dtype and ko.dtype == out_dtype
    assert q.grad.dtype == q.dtype and k.grad.dtype == k.dtype
    assert_close(qo, qro, out_dtype, msg="q_embed")
    assert_close(ko, kro, out_dtype, msg="k_embed")
    assert_close(q.grad, qr.grad, q.dtype, msg="dq")
    assert_close(k.grad, kr.grad, k.dtype, msg="dk")
    assert torch.equal(q.detach(), q_in) and torch.equal(k.detach(), k_in)  # inputs untouched
    return qo, ko


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_reference(shape, dtype, unsqueeze_dim, device):
    _check(*_make(shape, dtype, device, unsqueeze_dim), unsqueeze_dim=unsqueeze_dim)


# (B, Hq, Hk, S, D, R): partial rotary, cos/sin R < D wide
PARTIAL_SHAPES = [
    (1, 1, 1, 1, 4, 2),  # one rotated pair, seq 1
    (2, 3, 1, 5, 32, 8),  # GPT-NeoX's rotary_pct 0.25; odd head count, GQA
    (3, 5, 3, 4, 96, 24),  # D = 96, R not a power of two
    (1, 33, 5, 2, 512, 2),  # 510 passed through in 16 blocks of 32 (RopeConfig.block_p)
    (1, 2, 1, 3, 1024, 1000),  # half 500: the rotation loops over 4 blocks of 128
]


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", PARTIAL_SHAPES)
def test_partial_matches_reference(shape, dtype, device):
    *qk_shape, rot_dim = shape
    _check(*_make(tuple(qk_shape), dtype, device, rot_dim=rot_dim))


@pytest.mark.parametrize("cos_form", ["B", "1", "2d"])
def test_partial_layouts(cos_form, device):
    """[B, S, H, D] q/k (unsqueeze_dim 2) and the transposed projection view, with broadcast cos."""
    b, hq, hk, s, d, r = 2, 3, 1, 4, 16, 6
    q, k, cos, sin = _make((b, hq, hk, s, d), torch.float32, device, 2, cos_batch=1 if cos_form != "B" else None,
                           rot_dim=r)
    if cos_form == "2d":
        cos, sin = cos[0], sin[0]
    _check(q, k, cos, sin, unsqueeze_dim=2)
    _check(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=1)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_partial_matches_transformers_neox(dtype, device):
    """transformers' GPT-NeoX apply_rotary_pos_emb (rotates cos.shape[-1] of each head) on its own
    tables, run in fp64; the pass-through part is bit-exact."""
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    q, k, cos, sin = _make((2, 4, 2, 7, 32), dtype, device, cos_batch=1, hf_tables=True, rot_dim=8)
    qo, ko = apply_rope(q, k, cos, sin)
    qh, kh = neox.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, qh, dtype)
    assert_close(ko, kh, dtype)
    assert torch.equal(qo[..., 8:], q[..., 8:]) and torch.equal(ko[..., 8:], k[..., 8:])


def test_partial_pass_through_grad_is_identity(device):
    q, k, cos, sin = _make((2, 3, 1, 5, 24), torch.float32, device, rot_dim=10)
    q.requires_grad_()
    k.requires_grad_()
    qo, ko = apply_rope(q, k, cos, sin)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (dq, dk))
    assert torch.equal(q.grad[..., 10:], dq[..., 10:]) and torch.equal(k.grad[..., 10:], dk[..., 10:])


# (B, Hq, Hk, S, D, R) for the interleaved form, pairs (2i, 2i + 1)
INTERLEAVED_SHAPES = [
    (1, 1, 1, 1, 2, 2),
    (2, 3, 1, 5, 12, 12),  # odd head count, GQA, half 6
    (3, 5, 3, 4, 96, 96),
    (1, 2, 1, 3, 1024, 1024),  # half 512: 4 blocks of 128
    (2, 3, 1, 4, 40, 12),  # interleaved pairs in the first R, the rest passed through
]


# 2: torchtitan's [B, S, H, D]; 1 reads the same pairs through other strides (slow)
@pytest.mark.parametrize("unsqueeze_dim", [2, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", INTERLEAVED_SHAPES)
def test_interleaved_matches_reference(shape, dtype, unsqueeze_dim, device):
    *qk_shape, rot_dim = shape
    _check(*_make(tuple(qk_shape), dtype, device, unsqueeze_dim, rot_dim=rot_dim), unsqueeze_dim=unsqueeze_dim,
           interleaved=True)


def _titan_rope(xq, xk, freqs_cis):
    """torchtitan's apply_rotary_emb (complex multiplication), [B, S, H, D] and freqs_cis [S, D/2]."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * fc).flatten(3), torch.view_as_real(xk_ * fc).flatten(3)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_interleaved_matches_torchtitan(dtype, device):
    """The complex form on torchtitan's freqs_cis, in fp64; cos/sin are its real and imaginary
    parts, each repeated per pair."""
    b, hq, hk, s, d = 2, 3, 1, 7, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    freqs_cis = torch.polar(torch.ones(s, d // 2, dtype=torch.float64), torch.outer(torch.arange(s).double(), inv_freq))
    q, k, _, _ = _make((b, hq, hk, s, d), dtype, device, unsqueeze_dim=2)
    cos = freqs_cis.real.repeat_interleave(2, -1).to(device, dtype)
    sin = freqs_cis.imag.repeat_interleave(2, -1).to(device, dtype)
    qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=2, interleaved=True)
    qt, kt = _titan_rope(q.double(), k.double(), freqs_cis.to(device))
    assert_close(qo, qt, dtype)
    assert_close(ko, kt, dtype)


@pytest.mark.slow
def test_huge_head_dim(device):
    """head_dim 65536 (half 32768 = 256 blocks of 128) loops instead of erroring."""
    _check(*_make((1, 1, 2, 1, 65536), torch.bfloat16, device))


@pytest.mark.parametrize("cos_form", ["B", "1", "2d"])
def test_cos_broadcast(cos_form, device):
    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device, cos_batch=1 if cos_form != "B" else None)
    if cos_form == "2d":
        cos, sin = cos[0], sin[0]  # [S, D]
    _check(q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_transformers(dtype, unsqueeze_dim, device):
    """Same numbers as HF's own function on HF-style tables (HF rounds after each op in half
    precision; the kernel rounds once, so compare against HF run in fp64)."""
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, cos, sin = _make((2, 4, 2, 7, 16), dtype, device, unsqueeze_dim, cos_batch=1, hf_tables=True)
    qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    qh, kh = hf.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    assert_close(qo, qh, dtype)
    assert_close(ko, kh, dtype)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("view", ["transposed_projection", "fused_qkv_slice", "last_dim_strided"])
def test_non_contiguous(view, dtype, device):
    b, hq, hk, s, d = 2, 4, 2, 6, 8
    torch.manual_seed(1)
    if view == "transposed_projection":  # proj(x).view(B, S, H, D).transpose(1, 2)
        q = torch.randn(b, s, hq * d, device=device).to(dtype).view(b, s, hq, d).transpose(1, 2)
        k = torch.randn(b, s, hk * d, device=device).to(dtype).view(b, s, hk, d).transpose(1, 2)
    elif view == "fused_qkv_slice":  # qkv = proj(x); q, k = slices of it
        qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device).to(dtype)
        q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
        k = qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
    else:  # head_dim not unit-stride: the one layout that is copied
        q = torch.randn(b, hq, d, s, device=device).to(dtype).transpose(-1, -2)
        k = torch.randn(b, hk, d, s, device=device).to(dtype).transpose(-1, -2)
    assert not q.is_contiguous() and not k.is_contiguous()
    _, _, cos, sin = _make((b, hq, hk, s, d), dtype, device)
    qo, ko = _check(q, k, cos, sin)
    if view == "transposed_projection":  # output keeps q's memory layout, as eager's q * cos does
        assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("shape", [(2, 4, 2, 0, 8), (0, 4, 2, 5, 8)])
def test_empty(shape, device):
    q, k, cos, sin = _make(shape, torch.float32, device)
    q.requires_grad_()
    k.requires_grad_()
    qo, ko = apply_rope(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape
    (qo.sum() + ko.sum()).backward()
    assert q.grad.shape == q.shape


def test_promotes_like_eager(device):
    """fp32 cos with bf16 q: eager's q * cos is fp32, so is the kernel's output; grads are bf16."""
    q, k, _, _ = _make((1, 2, 1, 3, 8), torch.bfloat16, device)
    _, _, cos, sin = _make((1, 2, 1, 3, 8), torch.float32, device)
    qo, _ = _check(q, k, cos, sin)
    assert qo.dtype == torch.float32


def test_position_ids_compat(device):
    """position_ids is ignored (as in transformers 4.4x); an int there is unsqueeze_dim (transformers 5)."""
    q, k, cos, sin = _make((1, 3, 1, 4, 8), torch.float32, device, unsqueeze_dim=2)
    expected = apply_rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    for got in (apply_rope(q, k, cos, sin, 2), apply_rope(q, k, cos, sin, torch.arange(4), 2)):
        assert_close(got[0], expected[0])
        assert_close(got[1], expected[1])


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 3),
    hq=st.integers(1, 6),
    hk=st.integers(1, 6),
    s=st.integers(1, 7),
    half=st.integers(1, 40),
    n_pass=st.sampled_from([0, 0, 2, 6, 30]),  # partial rotary: D - R passed through
    interleaved=st.booleans(),
    unsqueeze_dim=st.sampled_from([1, 2]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(b, hq, hk, s, half, n_pass, interleaved, unsqueeze_dim, dtype, seed):
    q, k, cos, sin = _make((b, hq, hk, s, 2 * half + n_pass), dtype, DEVICE, unsqueeze_dim, seed=seed,
                           rot_dim=2 * half)
    _check(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)


def test_backward_is_inverse_rotation(device):
    """With HF tables (cos^2 + sin^2 = 1) the backward is the inverse rotation: bwd(fwd(x)) == x."""
    from kprof.kernels.rope import rope_bwd_op, rope_fwd_op

    q, k, cos, sin = _make((2, 3, 1, 5, 16), torch.float32, device, hf_tables=True)
    qo, ko = rope_fwd_op(q, k, cos, sin, 1)
    qb, kb = rope_bwd_op(qo, ko, cos, sin, 1)
    assert_close(qb, q)
    assert_close(kb, k)


def test_deterministic(device):
    q, k, cos, sin = _make((2, 4, 2, 5, 64), torch.bfloat16, device)
    q.requires_grad_()
    k.requires_grad_()
    outs = []
    for _ in range(2):
        q.grad = k.grad = None
        qo, ko = apply_rope(q, k, cos, sin)
        (qo.float().square().sum() + ko.float().sum()).backward()
        outs.append([t.detach().clone() for t in (qo, ko, q.grad, k.grad)])
    assert SPEC.deterministic
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_torch_compile_no_graph_break(device):
    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device, unsqueeze_dim=2)
    q.requires_grad_()
    k.requires_grad_()

    def attn_inputs(q, k, cos, sin):
        qe, ke = apply_rope(q, k, cos, sin, unsqueeze_dim=2)
        return qe * 2.0, ke + 1.0

    compiled = torch.compile(attn_inputs, backend="aot_eager", fullgraph=True)
    qc, kc = compiled(q, k, cos, sin)
    (qc.sum() + (kc * kc).sum()).backward()
    grads_c = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    qe, ke = attn_inputs(q, k, cos, sin)
    (qe.sum() + (ke * ke).sum()).backward()
    assert_close(qc, qe)
    assert_close(kc, ke)
    assert_close(grads_c[0], q.grad)
    assert_close(grads_c[1], k.grad)


def test_fallback_without_triton(monkeypatch):
    from kprof.kernels import common as _common

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_common, "_warned", set())
    q, k, cos, sin = _make((1, 2, 1, 3, 8), torch.float32, "cpu")
    with pytest.warns(UserWarning, match="rope.*reference"):
        qo, ko = apply_rope(q, k, cos, sin)
    qr, kr = apply_rope_reference(q, k, cos, sin)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)


def _bad(device, **over):
    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update({name: f(args) for name, f in over.items()})
    return args


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=lambda a: a["q"][0]), "q must be 4-D"),
        (dict(q=lambda a: a["q"].int()), "share one dtype"),
        (dict(k=lambda a: a["k"].half()), "share one dtype"),
        (dict(sin=lambda a: a["sin"].double()), "cos and sin must share"),
        (dict(k=lambda a: a["k"][:, :, :4]), "differ in batch, seq or head_dim"),
        (dict(q=lambda a: a["q"][..., :7], k=lambda a: a["k"][..., :7]), "head_dim must be even"),
        (dict(cos=lambda a: a["cos"][:, :, :3], sin=lambda a: a["sin"][:, :, :3]), "cos/sin must be"),  # R odd
        (dict(cos=lambda a: a["cos"].repeat(1, 1, 2), sin=lambda a: a["sin"].repeat(1, 1, 2)), "cos/sin must be"),
        (dict(cos=lambda a: a["cos"][:, :3], sin=lambda a: a["sin"][:, :3]), "cos/sin must be"),
        (dict(sin=lambda a: a["sin"][:1]), "differ in shape"),
        (dict(cos=lambda a: a["cos"][None], sin=lambda a: a["sin"][None]), "cos/sin must be"),
    ],
)
def test_bad_input(over, match, device):
    with pytest.raises(KprofError, match=match):
        apply_rope(**_bad(device, **over))


def test_cos_requiring_grad_is_refused(device):
    args = _bad(device)
    args["cos"].requires_grad_()
    with pytest.raises(KprofError, match="no grad|none"):
        apply_rope(**args)
    with torch.no_grad():  # no autograd, nothing lost
        apply_rope(**args)


def test_bad_unsqueeze_dim(device):
    with pytest.raises(KprofError, match="unsqueeze_dim must be 1"):
        apply_rope(**_bad(device), unsqueeze_dim=0)


def test_cost_model():
    c = SPEC.cost(batch=8, seq=2048, n_q_heads=32, n_kv_heads=32, head_dim=128, dtype=torch.bfloat16)
    qk = 2 * 8 * 32 * 2048 * 128  # elements of q and k
    cos_sin = 2 * 2048 * 128 * 2  # [1, S, D] cos and sin, bf16
    assert c["fwd"].bytes == 2 * qk * 2 + cos_sin and c["bwd"] == c["fwd"]
    assert c["fwd"].flops == 3 * qk
    m = registry.TensorMeta
    metas = [m((2, 8, 16, 64), torch.bfloat16), m((2, 2, 16, 64), torch.bfloat16),
             m((2, 16, 64), torch.float32), m((2, 16, 64), torch.float32)]
    n = 2 * 8 * 16 * 64 + 2 * 2 * 16 * 64
    assert registry.op_cost("kprof::rope_fwd", metas) == (3 * n, 2 * n * 2 + 2 * 2 * 16 * 64 * 4)
    assert registry.op_cost("kprof::rope_bwd", metas) == registry.op_cost("kprof::rope_fwd", metas)
    assert registry.get("rope") is SPEC


def test_cost_model_partial():
    """Partial rotary: FLOPs for the rotated R only, bytes for all of q and k plus R-wide cos/sin."""
    full = SPEC.cost(batch=2, seq=16, n_q_heads=8, n_kv_heads=2, head_dim=128, dtype=torch.bfloat16)["fwd"]
    part = SPEC.cost(batch=2, seq=16, n_q_heads=8, n_kv_heads=2, head_dim=128, dtype=torch.bfloat16, rot_dim=32)["fwd"]
    assert part.flops * 4 == full.flops and part.bytes == full.bytes - 2 * 16 * 96 * 2
    m = registry.TensorMeta
    metas = [m((2, 8, 16, 128), torch.bfloat16), m((2, 2, 16, 128), torch.bfloat16),
             m((1, 16, 32), torch.bfloat16), m((1, 16, 32), torch.bfloat16)]
    assert registry.op_cost("kprof::rope_fwd", metas) == (part.flops, part.bytes)


def test_expanded_grads(device):
    """`.sum().backward()` hands the backward stride-0 grads; they must be read correctly."""
    q, k, cos, sin = _make((2, 3, 1, 4, 8), torch.float32, device)
    q.requires_grad_()
    k.requires_grad_()
    qo, ko = apply_rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    qro, kro = apply_rope_reference(qr, kr, cos.double(), sin.double())
    (qro.sum() + kro.sum()).backward()
    assert_close(q.grad, qr.grad)
    assert_close(k.grad, kr.grad)


def test_patched_into_hf_llama(monkeypatch, device):
    """A tiny HF Llama (GQA) with apply_rotary_pos_emb swapped for apply_rope: same loss, same grads."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = modeling_llama.LlamaForCausalLM(cfg).to(device)
    ids = torch.randint(0, 64, (2, 7), device=device)

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = loss_and_grads()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return apply_rope(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", counted)
    loss, grads = loss_and_grads()
    assert calls  # the model really ran the kernel
    assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op dispatched below autograd (aten ops, kprof custom ops)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _LaunchLog:
    """Stands in for the Triton kernel: records launches (and their kwargs) instead of running."""

    def __init__(self):
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("rot_dim", [8, 4])  # 4: partial rotary, the pass-through in the same launch
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_eager_path_launches_directly(monkeypatch, unsqueeze_dim, rot_dim, device):
    """Eager fwd+bwd on HF's layouts (including the transposed projection view): no custom op,
    one launch each way, and the only tensor ops are the four output allocations - no transpose,
    expand or contiguous views (each op is ~12 us of host time on the H200 machine)."""
    from kprof.kernels import rope as mod

    launches = _LaunchLog()
    monkeypatch.setattr(mod, "_rope_kernel", launches)
    b, hq, hk, s, d = 2, 4, 2, 5, 8
    if unsqueeze_dim == 1:  # proj(x).view(B, S, H, D).transpose(1, 2)
        q = torch.randn(b, s, hq, d, device=device).transpose(1, 2).requires_grad_()
        k = torch.randn(b, s, hk, d, device=device).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(b, s, hq, d, device=device, requires_grad=True)
        k = torch.randn(b, s, hk, d, device=device, requires_grad=True)
    cos, sin = torch.randn(1, s, rot_dim, device=device), torch.randn(1, s, rot_dim, device=device)
    with _OpLog() as log:
        qo, ko = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        torch.autograd.backward((qo, ko), (torch.ones_like(qo), torch.ones_like(ko)))
    assert [(c["BACKWARD"], c["PASS"]) for c in launches.calls] == [(False, rot_dim < d), (True, rot_dim < d)]
    ops = [op for op in log.ops if op not in ("aten.detach.default", "aten.ones_like.default")]
    assert ops == ["aten.empty_like.default"] * 2 + ["aten.empty_strided.default"] * 2, log.ops


def test_grads_keep_input_layout(device):
    """dq, dk come out in q's and k's layout (here the transposed [B, S, H, D] projection view),
    so the transpose/view backward upstream needs no copy."""
    b, hq, hk, s, d = 2, 4, 2, 5, 8
    x_q = torch.randn(b, s, hq * d, device=device, requires_grad=True)
    x_k = torch.randn(b, s, hk * d, device=device, requires_grad=True)
    q, k = x_q.view(b, s, hq, d).transpose(1, 2), x_k.view(b, s, hk, d).transpose(1, 2)
    seen = []
    q.register_hook(lambda g: seen.append(("q", g.stride())))
    k.register_hook(lambda g: seen.append(("k", g.stride())))
    _, _, cos, sin = _make((b, hq, hk, s, d), torch.float32, device)
    qo, ko = apply_rope(q, k, cos, sin)
    (qo.square().sum() + ko.sum()).backward()
    assert sorted(seen) == [("k", k.stride()), ("q", q.stride())]
    qr, kr = x_q.detach().view(b, s, hq, d).transpose(1, 2), x_k.detach().view(b, s, hk, d).transpose(1, 2)
    qr, kr = qr.double().requires_grad_(), kr.double().requires_grad_()
    qro, kro = apply_rope_reference(qr, kr, cos.double(), sin.double())
    (qro.square().sum() + kro.sum()).backward()
    assert_close(x_q.grad.view(b, s, hq, d).transpose(1, 2), qr.grad)
    assert_close(x_k.grad.view(b, s, hk, d).transpose(1, 2), kr.grad)


def test_profiler_sees_custom_ops(device):
    """While a profiler records, the calls go through kprof::rope_fwd/_bwd (the cost model reads
    their shapes from the trace); results equal the eager path's, grads too."""
    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device)
    q.requires_grad_()
    k.requires_grad_()
    qe, ke = apply_rope(q, k, cos, sin)
    (qe.square().sum() + ke.sum()).backward()
    grads = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    with torch.profiler.profile() as prof:
        qo, ko = apply_rope(q, k, cos, sin)
        (qo.square().sum() + ko.sum()).backward()
    names = {e.name for e in prof.events()}
    assert {"kprof::rope_fwd", "kprof::rope_bwd"} <= names
    assert torch.equal(qo, qe) and torch.equal(ko, ke)
    assert torch.equal(q.grad, grads[0]) and torch.equal(k.grad, grads[1])


@pytest.mark.parametrize("unsqueeze_dim", [1, pytest.param(2, marks=pytest.mark.slow)])  # the same registration
def test_custom_ops_opcheck(unsqueeze_dim, device):
    from kprof.kernels.rope import rope_bwd_op, rope_fwd_op

    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device, unsqueeze_dim)
    torch.library.opcheck(rope_fwd_op, (q, k, cos, sin, unsqueeze_dim))
    torch.library.opcheck(rope_bwd_op, (q, k, cos, sin, unsqueeze_dim))


@pytest.mark.slow  # the registration above, with its bool argument set
def test_custom_ops_opcheck_interleaved(device):
    from kprof.kernels.rope import rope_bwd_op, rope_fwd_op

    q, k, cos, sin = _make((2, 4, 2, 5, 8), torch.float32, device, 2)
    torch.library.opcheck(rope_fwd_op, (q, k, cos, sin, 2, True))
    torch.library.opcheck(rope_bwd_op, (q, k, cos, sin, 2, True))


def test_many_heads_loop(device):
    """More heads than one tile holds (2 * (2048 + 4) * 8 > 16384 elements): heads loop in blocks."""
    from kprof.kernels.rope import RopeConfig

    assert not RopeConfig.for_shape(1100, 3, 8).one_tile
    _check(*_make((1, 1100, 3, 2, 16), torch.float32, device))


# The interpreter accepts code the compiler rejects and shows no memory instructions, so CPU CI
# also compiles the kernel for sm_90 ahead of time (in a subprocess without TRITON_INTERPRET;
# ptxas ships with Triton) and checks its global memory accesses are 16-byte vectors.
AOT_SCRIPT = r"""
import os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kprof.kernels import rope

fn = rope._rope_kernel
ints = [a for a in fn.arg_names if not a.endswith("_ptr")]
for consts, warps in eval(sys.argv[1]):
    sig = {a: "constexpr" if a in consts else "*bf16" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
    # Pointers and the strides/half of the benchmark layouts are multiples of 16 (as the launcher
    # specializes them); the counts are not.
    div16 = [i for i, a in enumerate(fn.arg_names)
             if a not in consts and (a.endswith("_ptr") or (a in ints and "heads" not in a and a != "seq_len"))]
    src = ASTSource(fn, sig, consts, {(i,): [["tt.divisibility", 16]] for i in div16})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    mem = re.findall(r"(?:ld|st)\.global[.\w]*", ptx)
    print("compiled", consts, sorted(set(mem)))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernel")
def test_kernel_compiles_for_sm90_with_vector_accesses():
    pytest.importorskip("triton.backends.nvidia")
    import os
    import subprocess
    import sys

    from kprof.kernels.rope import RopeConfig

    variants = []
    for n_q, n_k in ((32, 32), (32, 8), (64, 8)):  # Llama, Llama-3 GQA, Llama-70B: one tile each
        c = RopeConfig.for_shape(n_q, n_k, 64)
        assert c.one_tile
        for bwd in (False, True):
            variants.append((dict(BLOCK_HQ=c.block_hq, BLOCK_HK=c.block_hk, BLOCK_D=c.block_d, ONE_TILE=True,
                                  BACKWARD=bwd, PASS=False, BLOCK_P=c.block_p, INTERLEAVED=False), c.num_warps))
    c = RopeConfig.for_shape(40, 8, 128)  # head_dim 256 with 40 heads: heads loop in blocks
    assert not c.one_tile
    variants.append((dict(BLOCK_HQ=c.block_hq, BLOCK_HK=c.block_hk, BLOCK_D=c.block_d, ONE_TILE=False,
                          BACKWARD=False, PASS=False, BLOCK_P=c.block_p, INTERLEAVED=False), c.num_warps))
    c = RopeConfig.for_shape(32, 32, 16, 96)  # GPT-NeoX: R = 32 of head_dim 128, 96 copied through
    assert c.one_tile
    for bwd in (False, True):
        variants.append((dict(BLOCK_HQ=c.block_hq, BLOCK_HK=c.block_hk, BLOCK_D=c.block_d, ONE_TILE=True,
                              BACKWARD=bwd, PASS=True, BLOCK_P=c.block_p, INTERLEAVED=False), c.num_warps))
    c = RopeConfig.for_shape(32, 8, 64)  # torchtitan's Llama-3 8B: interleaved pairs
    for bwd in (False, True):
        variants.append((dict(BLOCK_HQ=c.block_hq, BLOCK_HK=c.block_hk, BLOCK_D=c.block_d, ONE_TILE=True,
                              BACKWARD=bwd, PASS=False, BLOCK_P=c.block_p, INTERLEAVED=True), c.num_warps))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, repr(variants)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("compiled")]
    assert len(lines) == len(variants)
    for ln in lines:
        if "'INTERLEAVED': True" in ln:  # pairs (2i, 2i + 1) are stride-2 loads: compiled, not vectors
            continue
        # bf16 in vectors: 16 bytes (v4.b32) for the big tiles; the [8, 64] k tile of GQA has only
        # 4 elements per thread at 4 warps, so 8 bytes (v2.b32) there. A scalar access (b16, b32)
        # would mean the alignment/contiguity was lost. (The looped path at BLOCK_D 128 loads its
        # [1, 128] cos/sin rows as scalars, 1 KB per program from L2; only its q/k tiles are checked.)
        assert "ld.global.v4.b32" in ln and "st.global.v4.b32" in ln, ln
        if "'ONE_TILE': True" in ln:
            assert not any(f"global.{w}'" in ln for w in ("b16", "b32")), ln
