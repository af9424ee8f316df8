"""The fused MoE patch (rules/moe_fused.py, issue 21 item 5): recognised blocks patched and
verified forward and backward (weight grads included), the routing compared where it is decided,
no host sync in the patched forward, and the blocks it must decline declined with the reason."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import kprof
from kprof.rules import moe_fused

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import HIDDEN, DenseMaskMoE, LoopMoE, hf_model  # noqa: E402


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if moe_fused.moe.structure(m) is not None
            and moe_fused.moe.match(p, m) is not None]


def _patch_and_compare(block: nn.Module, dtype: torch.dtype, tokens: int = 12):
    """Patch `block` (strict: a failed verification raises), run forward + backward on it and on
    an unpatched copy, and return the report and the two sides' outputs and grads."""
    block = block.to(dtype)
    ref = copy.deepcopy(block)
    report = kprof.patch(block, rules=[moe_fused.ID], strict=True)
    assert [r.rule for r in report.records] == [moe_fused.ID], str(report)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, tokens // 2, HIDDEN, generator=g).to(dtype)
    outs, grads = [], []
    for m in (block, ref):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.float().pow(2).sum().backward()
        outs.append(y.detach().float())
        grads.append([xi.grad.float()] + [p.grad.float() for p in m.parameters()])
    return report, outs, grads


def _assert_close(outs, grads, dtype):
    # fp32: both sides compute the same sums in another order (~1e-6 apart); bf16: the patched
    # side rounds once where eager rounds per op, so compare by relative norm at bf16's scale.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip([outs[0]] + grads[0], [outs[1]] + grads[1]):
        assert a.shape == b.shape
        assert (a - b).norm() <= tol * b.norm() + 1e-6


def test_loop_moe_patched_and_verified_fp32():
    """The hand-written ModuleList MoE (the fast case): verified at its first call; outputs, input
    and every weight grad (router and each expert's three Linears) match the unpatched block."""
    torch.manual_seed(0)
    report, outs, grads = _patch_and_compare(LoopMoE(), torch.float32)
    rec = report.records[0]
    assert rec.status == "verified" and rec.verification.ok, str(report)
    assert rec.params["layout"] == "stacked per call" and rec.params["renorm"] is True
    _assert_close(outs, grads, torch.float32)
    report.unpatch()


@pytest.mark.slow
def test_loop_moe_patched_and_verified_bf16():
    torch.manual_seed(0)
    report, outs, grads = _patch_and_compare(LoopMoE(), torch.bfloat16)
    assert report.records[0].status == "verified"
    assert report.records[0].verification.method == "fp32 truth"
    _assert_close(outs, grads, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,mode,shared", [("mixtral", "eager", "none"), ("mixtral", "grouped_mm", "none"),
                                              ("qwen2_moe", None, "sigmoid-gated"), ("olmoe", None, "none")])
def test_hf_moe_blocks_patched_and_verified(arch, mode, shared, dtype):
    model = hf_model(arch)
    if mode is not None:
        model.config._experts_implementation = mode
    path, block = _blocks(model)[-1]
    report, outs, grads = _patch_and_compare(block, dtype)
    rec = report.records[0]
    assert rec.status == "verified", str(report)
    assert rec.params["layout"] == "linear layout" and rec.params["shared"] == shared
    _assert_close(outs, grads, dtype)


def test_deepseek_declined_with_its_reason():
    model = hf_model("deepseek_v3")
    report = kprof.patch(model, rules=[moe_fused.ID])
    assert report.records == []
    notes = [r.note for r in report.declined if r.rule == moe_fused.ID]
    assert notes and all("group-limited routing" in n for n in notes)


def test_non_swiglu_experts_declined():
    """Stacked [E, H, I] / [E, I, H] GELU experts (not gated): no SwiGLU reading of the weights fits."""
    _, why = moe_fused.plan("", DenseMaskMoE())
    assert why is not None and "stacked expert weights" in why


def test_router_jitter_declined():
    """HF Mixtral with router jitter: random in training, so the deterministic fused path declines."""
    model = hf_model("mixtral")
    _, block = _blocks(model)[-1]
    block.jitter_noise = 0.1  # what config.router_jitter_noise sets
    block.eval()  # inactive in eval, but training will switch it on: probed in training mode
    _, why = moe_fused.plan("", block)
    assert why is not None and "random in training" in why
    assert not any(c.training for c in block.modules())  # the probe put the modes back


class _CapacityMoE(LoopMoE):
    """LoopMoE that keeps at most `cap` tokens per expert (a capacity factor): the rest dropped.
    40 of the probe's 48 tokens: never reached by a random router (16 a expert on average), always
    when every token picks the same experts."""

    cap = 40

    def kept(self, rows, slot):
        return rows[: self.cap], slot[: self.cap]


def test_capacity_factor_declined():
    torch.manual_seed(0)
    _, why = moe_fused.plan("", _CapacityMoE())
    assert why is not None and "capacity" in why


class _Syncs(TorchFunctionMode):
    """Records the calls that read a device value back to the host."""

    SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.nonzero, torch.Tensor.nonzero, torch.Tensor.__bool__,
               torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCING or (func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1):
            self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def test_patched_forward_makes_no_host_sync():
    """The eager block syncs (torch.where per expert); the patched forward, fwd and bwd, does not."""
    torch.manual_seed(0)
    block = LoopMoE()
    x = torch.randn(2, 6, HIDDEN)
    with _Syncs() as eager:
        block(x)
    assert "where" in eager.seen  # the recorder sees the eager block's syncs
    params, why = moe_fused.plan("", block)
    assert why is None
    fused = moe_fused.build(block, params["moe"], params)
    with _Syncs() as rec:
        fused(x.requires_grad_(True)).sum().backward()
    assert rec.seen == []


def test_routing_check_only_decided_tokens_must_agree():
    """Token 0 is a near-tie between experts 1 and 2 for the 2nd pick (either is correct);
    token 1 is decided. k = 2 of 4 experts."""
    scores = torch.tensor([[0.40, 0.30, 0.30 - 1e-7, 0.0], [0.5, 0.3, 0.1, 0.1]])
    w = torch.tensor([[0.6, 0.4], [0.6, 0.4]])
    idx = torch.tensor([[0, 1], [0, 1]])
    flipped = torch.tensor([[0, 2], [0, 1]])
    ok, what = moe_fused.routing_check(scores, idx, w, flipped, w, 2, torch.float32)
    assert ok and "1 of 2 tokens decided" in what
    wrong = torch.tensor([[0, 1], [0, 2]])  # the decided token picked another expert
    ok, what = moe_fused.routing_check(scores, idx, w, wrong, w, 2, torch.float32)
    assert not ok and "chose other experts" in what
    # same experts in another order: matched by expert, so the weights must follow them
    ok, _ = moe_fused.routing_check(scores, idx, w, idx.flip(-1), w.flip(-1), 2, torch.float32)
    assert ok
    ok, what = moe_fused.routing_check(scores, idx, w, idx, w + torch.tensor([[0.0, 0.0], [0.1, -0.1]]), 2,
                                       torch.float32)
    assert not ok and "other routing weights" in what


def test_routing_check_tie_width_is_the_dtypes_tolerance():
    """A gap of 1e-3 is decided in fp32 but a near-tie in bf16 (atol 1e-2 in the table)."""
    scores = torch.tensor([[0.5, 0.3, 0.299, 0.0]])
    a, b = torch.tensor([[0, 1]]), torch.tensor([[0, 2]])
    w = torch.tensor([[0.6, 0.4]])
    assert not moe_fused.routing_check(scores, a, w, b, w, 2, torch.float32)[0]
    assert moe_fused.routing_check(scores, a, w, b, w, 2, torch.bfloat16)[0]


@pytest.mark.slow
def test_first_call_verification_compares_the_routing(monkeypatch):
    """The routing check is part of the first-call verification: passing on a correct patch,
    failing it (strict: an error, the original code kept) when the fused routing picks other
    experts than the block's own top-k."""
    from kprof.errors import KprofError

    torch.manual_seed(0)
    block = LoopMoE()
    x = torch.randn(2, 6, HIDDEN)
    report = kprof.patch(block, rules=[moe_fused.ID], strict=True)
    block(x)
    checks = [c for c in report.records[0].verification.checks if c.metric == "exact"]
    assert [c.ok for c in checks] == [True] and "routing agrees" in str(checks[0])
    report.unpatch()

    report = kprof.patch(block, rules=[moe_fused.ID], strict=True)
    route = moe_fused._fused_routing  # broken after matching: the match probe checks it too
    monkeypatch.setattr(moe_fused, "_fused_routing", lambda logits, *a: route(-logits, *a))  # the k lowest
    with pytest.raises(KprofError, match="chose other experts"):
        block(x)
    assert report.records[0].status == "reverted" and "forward" not in block.__dict__


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["loop", "mixtral", "qwen2_moe"])
def test_patched_block_makes_no_host_sync_on_gpu(arch):
    """On the GPU the sync detector of torch itself: the patched forward and backward, after its
    first (verified) call, raise under set_sync_debug_mode("error") if anything reads back."""
    if arch == "loop":
        torch.manual_seed(0)
        block = LoopMoE()
    else:
        block = _blocks(hf_model(arch))[-1][1]
    block = block.cuda().to(torch.bfloat16)
    report = kprof.patch(block, rules=[moe_fused.ID], strict=True)
    x = torch.randn(4, 64, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block(x)  # the first call verifies (the original code syncs)
    assert report.records[0].status == "verified"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _SigmoidStackedMoE(nn.Module):
    """Stacked weights in the x @ W layout ([E, H, 2I] with UP first, [E, I, H]), a bare router
    Parameter, sigmoid scores renormalised over the top-k; every expert computed densely, the
    picked ones gathered. Unlike the HF blocks in layout, half order, score and dispatch."""

    def __init__(self, dim: int = HIDDEN, n_experts: int = 4, k: int = 2, inter: int = 16):
        super().__init__()
        self.k = k
        self.gate_w = nn.Parameter(torch.randn(n_experts, dim) * 0.2)
        self.w_gu = nn.Parameter(torch.randn(n_experts, dim, 2 * inter) * 0.2)
        self.w_down = nn.Parameter(torch.randn(n_experts, inter, dim) * 0.2)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top, idx = torch.topk(torch.sigmoid(x @ self.gate_w.t()), self.k, dim=-1)
        w = top / top.sum(-1, keepdim=True)
        up, gate = torch.einsum("th,ehi->tei", x, self.w_gu).chunk(2, dim=-1)
        y = torch.einsum("tei,eih->teh", F.silu(gate) * up, self.w_down)
        y = y.gather(1, idx[..., None].expand(-1, -1, shape[-1]))
        return (y * w[..., None]).sum(1).reshape(shape)


@pytest.mark.slow
def test_sigmoid_matmul_layout_up_first_patched():
    torch.manual_seed(0)
    params, why = moe_fused.plan("", _SigmoidStackedMoE())
    assert why is None
    assert (params["layout"], params["up_first"], params["score"], params["renorm"]) == (
        "matmul layout", True, "sigmoid", True)
    torch.manual_seed(0)
    report, outs, grads = _patch_and_compare(_SigmoidStackedMoE(), torch.float32)
    assert report.records[0].status == "verified"
    _assert_close(outs, grads, torch.float32)
