"""kprof's kernels under torch.compile(fullgraph=True): the registration of `common.kernel_op`.

Three levels:
- CPU, in process (Triton interpreter): Dynamo captures each kernel function and module whole
  (no graph break, `torch._dynamo.explain` agrees), the captured graph's forward and backward
  bodies call the `kprof::*` ops (not the reference, not a traced-through launcher), and the
  compiled call gives the eager call's outputs and gradients bit for bit (the same kernels run).
- CPU, in a subprocess without the interpreter (kernels are JITFunctions, as on a GPU; the
  tensors are fake CUDA tensors, meta ones for linear+CE): each op is a `torch.library.triton_op`
  whose body AOTAutograd decomposes into `triton_kernel_wrapper_functional` nodes naming kprof's
  own Triton kernels, which is what lets Inductor launch them from its generated code (linear+CE's
  matmuls stay aten nodes beside them). Nothing runs there.
- GPU (marked): the inductor backend, fullgraph=True, outputs and gradients within the dtype's
  tolerance of eager, and the generated code launches the kernels with no call back into a
  `kprof::` op.
"""

from __future__ import annotations

import pytest
import torch

from kprof.kernels import bias_gelu, cross_entropy, fused_linear_cross_entropy, glu, layer_norm, rms_norm, rope, softmax
from kprof.kernels.common import assert_close

gpu = pytest.mark.gpu


def _t(*shape, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _rope_inputs(device, dtype):
    q, k = _t(2, 4, 6, 16, device=device, dtype=dtype), _t(2, 2, 6, 16, device=device, dtype=dtype, seed=1)
    ang = _t(1, 6, 16, device=device, dtype=torch.float32, seed=2)
    return [q, k], [ang.cos().to(dtype), ang.sin().to(dtype)]


def _targets(n, vocab, device):
    """Class indices with every third one ignored (the default ignore_index, -100)."""
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n + vocab))
    t[::3] = -100
    return t.to(device)


def _ce_inputs(device, dtype):
    return [_t(6, 37, device=device, dtype=dtype)], [_targets(6, 37, device)]


def _lce_inputs(device, dtype):
    h, w = _t(6, 16, device=device, dtype=dtype), _t(37, 16, device=device, dtype=dtype, seed=1)
    return [h, w / 4, _t(37, device=device, dtype=dtype, seed=2)], [_targets(6, 37, device)]


# name -> (make(device, dtype) -> (differentiable inputs, constant inputs), call, fwd ops, bwd ops).
# Odd widths (37, 45) so the masked tails run; bf16 and fp32 below.
CASES = {
    "rms_norm": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(37, device=d, dtype=dt)], []),
        lambda x, w: rms_norm.rms_norm(x, w, 1e-6),
        {"rms_norm_fwd"}, {"rms_norm_bwd"},
    ),
    "rms_norm_gemma_module": (
        lambda d, dt: ([_t(2, 3, 45, device=d, dtype=dt)], []),
        None,  # the module, built in the test (its weight is a parameter)
        {"rms_norm_fwd"}, {"rms_norm_bwd"},
    ),
    "rms_norm_add": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(3, 37, device=d, dtype=dt, seed=1),
                        _t(37, device=d, dtype=dt, seed=2)], []),
        lambda x, r, w: rms_norm.rms_norm_add(x, r, w, 1e-6),
        {"rms_norm_add_fwd"}, {"rms_norm_bwd"},
    ),
    "layer_norm": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(37, device=d, dtype=dt, seed=1),
                        _t(37, device=d, dtype=dt, seed=2)], []),
        lambda x, w, b: layer_norm.layer_norm(x, w, b, 1e-5),
        {"layer_norm_fwd"}, {"layer_norm_bwd"},
    ),
    "swiglu": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(3, 37, device=d, dtype=dt, seed=1)], []),
        glu.swiglu,
        {"swiglu_fwd"}, {"swiglu_bwd"},
    ),
    "geglu": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(3, 37, device=d, dtype=dt, seed=1)], []),
        lambda g, u: glu.geglu(g, u, "none"),
        {"geglu_fwd"}, {"geglu_bwd"},
    ),
    "swiglu_packed": (
        lambda d, dt: ([_t(3, 2 * 37, device=d, dtype=dt)], []),
        glu.swiglu_packed,
        {"swiglu_packed_fwd"}, {"swiglu_packed_bwd"},
    ),
    "geglu_packed": (
        lambda d, dt: ([_t(3, 2 * 37, device=d, dtype=dt)], []),
        lambda gu: glu.geglu_packed(gu, "tanh"),
        {"geglu_packed_fwd"}, {"geglu_packed_bwd"},
    ),
    "bias_gelu": (
        lambda d, dt: ([_t(3, 37, device=d, dtype=dt), _t(37, device=d, dtype=dt, seed=1)], []),
        lambda x, b: bias_gelu.bias_gelu(x, b, "tanh"),
        {"bias_gelu_fwd"}, {"bias_gelu_bwd"},
    ),
    "softmax_causal": (
        lambda d, dt: ([_t(2, 5, 37, device=d, dtype=dt)], []),
        lambda x: softmax.softmax(x, scale=0.125, causal=True),
        {"softmax_fwd"}, {"softmax_bwd"},
    ),
    "rope": (
        _rope_inputs,
        lambda q, k, cos, sin: rope.apply_rope(q, k, cos, sin),
        {"rope_fwd"}, {"rope_bwd"},
    ),
    # The losses' grad_output is not 1 here (`_run` takes sin of the loss), so the backward's
    # scaling kernel does work.
    "cross_entropy": (
        _ce_inputs,
        lambda z, t: cross_entropy.cross_entropy(z, t, label_smoothing=0.1, z_loss=1e-3),
        {"cross_entropy_fwd"}, {"cross_entropy_bwd"},
    ),
    "cross_entropy_softcap_none": (
        _ce_inputs,
        lambda z, t: cross_entropy.cross_entropy(z, t, reduction="none", softcap=2.0),
        {"cross_entropy_fwd"}, {"cross_entropy_bwd"},
    ),
    "cross_entropy_inplace": (
        _ce_inputs,
        # logits * 1: the gradient overwrites a non-leaf, as it would a model's logits
        lambda z, t: cross_entropy.cross_entropy(z * 1.0, t, reduction="sum", inplace_grad=True),
        {"cross_entropy_fwd_inplace"}, {"cross_entropy_bwd"},
    ),
    "linear_cross_entropy": (  # two chunks, bias, an fp32 loss
        _lce_inputs,
        lambda h, w, b, t: fused_linear_cross_entropy.linear_cross_entropy(
            h, w, t, b, label_smoothing=0.1, chunk_size=4, loss_dtype=torch.float32),
        {"linear_cross_entropy_fwd"}, {"cross_entropy_bwd"},
    ),
    "linear_cross_entropy_none": (  # recomputed in the backward
        _lce_inputs,
        lambda h, w, b, t: fused_linear_cross_entropy.linear_cross_entropy(
            h, w, t, b, reduction="none", z_loss=1e-3, softcap=2.0, chunk_size=4),
        {"linear_cross_entropy_fwd"}, {"linear_cross_entropy_bwd"},
    ),
}


def _build(name, device, dtype):
    make, call, fwd_ops, bwd_ops = CASES[name]
    grads, consts = make(device, dtype)
    if call is None:
        mod = rms_norm.RMSNorm(45, eps=1e-6, offset=1.0, casting="gemma", device=device, dtype=dtype)
        with torch.no_grad():
            mod.weight.copy_(_t(45, device=device, dtype=dtype, seed=3))
        call = mod
    return grads, consts, call, fwd_ops, bwd_ops


def _run(fn, grads, consts):
    """fn's outputs and the gradients of every differentiable input (and parameter) after one
    backward of a fixed weighted sum of the outputs."""
    leaves = [t.detach().clone().requires_grad_() for t in grads]
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    for p in params:
        p.grad = None
    outs = fn(*leaves, *consts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * (i + 1.5)).sin().sum() for i, o in enumerate(outs))
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves] + [p.grad.clone() for p in params]


def _kprof_ops(gm: torch.fx.GraphModule, body: str) -> set[str]:
    """Names of the kprof:: ops called anywhere in the submodules of `gm` whose name starts with
    `body` (Dynamo puts an autograd.Function's traced forward and backward in fwd_body_N and
    bwd_body_N)."""
    found = set()
    for name, mod in gm.named_modules():
        if not name.startswith(body) or not isinstance(mod, torch.fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            target = node.target
            if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                ns, _, op = target._qualified_op_name.partition("::") if hasattr(
                    target, "_qualified_op_name") else str(target).partition(".")
                if ns == "kprof":
                    found.add(op.split(".")[0])
    return found


# fp32 is slow: the captured graph is the same in both dtypes, and the kernels' fp32 path runs in
# their own tests.
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_captures_the_kprof_ops(name, dtype, device):
    grads, consts, call, fwd_ops, bwd_ops = _build(name, device, dtype)
    torch._dynamo.reset()

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):  # Dynamo's graph, run as it is (the "eager" backend plus a record)
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(call, backend=capture, fullgraph=True)
    got = _run(compiled, grads, consts)
    assert len(graphs) == 1
    assert _kprof_ops(graphs[0], "fwd_body") == fwd_ops
    assert _kprof_ops(graphs[0], "bwd_body") == bwd_ops

    explained = torch._dynamo.explain(call)(*grads, *consts)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    want = _run(call, grads, consts)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same Triton kernels run, compiled or not


# Each op, traced as AOTAutograd traces it (FunctionalTensorMode over fake CUDA tensors), must
# become launches of the module's own kernels and nothing opaque. The SM count is the H200's (132),
# which only sizes the persistent grids; nothing is launched or compiled.
TRITON_OP_SCRIPT = r"""
import sys
import types
import warnings
import torch
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(multi_processor_count=132)
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
REFUSE = sys.argv[1:] == ["refuse"]
if REFUSE:  # a torch that rejects every triton_op registration
    def refuse(*args, **kwargs):
        raise RuntimeError("refused")
    torch.library.triton_op = refuse
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kprof.kernels import bias_gelu, cross_entropy, fused_linear_cross_entropy, glu, layer_norm, rms_norm, rope, softmax
if REFUSE:
    print("warned", ",".join(sorted(str(w.message).split(" ")[1] for w in caught if "plain custom op" in str(w.message))))
K = torch.ops.kprof
fm = FakeTensorMode()
with fm:
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, r, w, b = torch.randn(4, 37, **bf), torch.randn(4, 37, **bf), torch.randn(37, **bf), torch.randn(37, **bf)
    gu, s = torch.randn(4, 74, **bf), torch.randn(2, 5, 37, **bf)
    q, k, cos = torch.randn(2, 4, 6, 16, **bf), torch.randn(2, 2, 6, 16, **bf), torch.randn(1, 6, 16, **bf)
    rstd = torch.randn(4, device="cuda")
    stats = torch.randn(3, 4, device="cuda")
    tgt, one = torch.randint(0, 37, (4,), device="cuda"), torch.ones((), device="cuda")
    # linear+CE slices its inputs into chunks, which a fake CUDA tensor cannot do here (see
    # NOT_HERE): its body is traced on meta tensors, as the CE kernel's interpreter configuration.
    meta = dict(device="meta", dtype=torch.bfloat16)
    h, W, hb = torch.randn(4, 16, **meta), torch.randn(37, 16, **meta), torch.randn(37, **meta)
    mt = torch.randint(0, 37, (4,), device="meta")
    m1 = torch.ones((), device="meta")
CALLS = {
    "rms_norm_fwd": (K.rms_norm_fwd, (x, w, 1e-6, 0.0, "llama",)),
    "rms_norm_add_fwd": (K.rms_norm_add_fwd, (x, r, w, 1e-6, 1.0, "gemma",)),
    "rms_norm_bwd": (K.rms_norm_bwd, (x, x, w, rstd, r, 0.0,)),
    "layer_norm_fwd": (K.layer_norm_fwd, (x, w, b, 1e-5,)),
    "layer_norm_bwd": (K.layer_norm_bwd, (x, x, w, stats, torch.bfloat16, torch.bfloat16,)),
    "swiglu_fwd": (K.swiglu_fwd, (x, r,)),
    "swiglu_bwd": (K.swiglu_bwd, (x, x, r,)),
    "geglu_fwd": (K.geglu_fwd, (x, r, "none",)),
    "geglu_bwd": (K.geglu_bwd, (x, x, r, "tanh",)),
    "swiglu_packed_fwd": (K.swiglu_packed_fwd, (gu,)),
    "swiglu_packed_bwd": (K.swiglu_packed_bwd, (x, gu,)),
    "geglu_packed_fwd": (K.geglu_packed_fwd, (gu, "tanh",)),
    "geglu_packed_bwd": (K.geglu_packed_bwd, (x, gu, "tanh",)),
    "bias_gelu_fwd": (K.bias_gelu_fwd, (x, b, "tanh",)),
    "bias_gelu_bwd": (K.bias_gelu_bwd, (x, x, b, "none",)),
    "softmax_fwd": (K.softmax_fwd, (s, None, 0.5, True,)),
    "softmax_bwd": (K.softmax_bwd, (s, s, 0.5, True,)),
    "rope_fwd": (K.rope_fwd, (q, k, cos, cos, 1,)),
    "rope_bwd": (K.rope_bwd, (q, k, cos, cos, 1,)),
    "cross_entropy_fwd": (K.cross_entropy_fwd, (x, tgt, one, -100, 0.1, 1e-3, 0.0, True,)),
    "cross_entropy_fwd_inplace": (K.cross_entropy_fwd_inplace, (x, tgt, one, -100, 0.0, 0.0, 2.0,)),
    "cross_entropy_bwd": (K.cross_entropy_bwd, (x, rstd,)),
    # two chunks of 2 rows; all grads, bias
    "linear_cross_entropy_fwd": (K.linear_cross_entropy_fwd,
                                 (h, W, hb, mt, m1, -100, 0.1, 0.0, 0.0, True, True, True, 2, False,)),
    # reduction='none': per-row grad_output, no bias, grad_W accumulated in fp32
    "linear_cross_entropy_bwd": (K.linear_cross_entropy_bwd,
                                 (h, W, None, mt, mt.float(), -100, 0.0, 1e-3, 2.0, True, True, False, 2, True,)),
}
# Indexing a fake CUDA tensor (`stats[2]`, `gu2[:, :i]`) needs a CUDA device guard, which a CPU
# build of torch lacks: these bodies are traced on the GPU only; here they are checked registered.
NOT_HERE = {"layer_norm_fwd", "layer_norm_bwd", "swiglu_packed_fwd", "swiglu_packed_bwd", "geglu_packed_fwd",
            "geglu_packed_bwd"}
# linear+CE with a symbolic token count, as torch.compile's dynamic shapes trace it: make_fx's
# symbolic mode fakes these (real) meta tensors itself.
sh, sw, st = torch.empty(4, 16, **meta), torch.empty(37, 16, **meta), torch.zeros(4, dtype=torch.int64, device="meta")
SYMBOLIC = {
    "linear_cross_entropy_fwd@symbolic": (K.linear_cross_entropy_fwd, (sh, sw, None, st, torch.ones((), device="meta"),
                                           -100, 0.0, 0.0, 0.0, True, True, False, 2, False,)),
    "linear_cross_entropy_bwd@symbolic": (K.linear_cross_entropy_bwd, (sh, sw, None, st, st.float(),
                                           -100, 0.0, 0.0, 0.0, True, True, False, 2, False,)),
}
for name, (op, args) in [*CALLS.items(), *SYMBOLIC.items()]:
    if name in NOT_HERE and not REFUSE:  # (refused, only their shapes-only fakes are traced)
        print(name, "triton_op" if f"kprof::{name}" in torch._library.triton.triton_ops_to_kernels else "-", "-", "-")
        continue
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*ts, op=op, args=args, tensors=tensors):  # tensors are the traced inputs, the rest constants
        full = list(args)
        for i, t in zip(tensors, ts):
            full[i] = t
        return op(*full)

    traced = (args[i] for i in tensors)
    if name in SYMBOLIC:
        gm = make_fx(dispatch_functionalize(call), tracing_mode="symbolic")(*traced)
    else:
        with fm:
            gm = make_fx(dispatch_functionalize(call))(*traced)
    kernels, opaque, matmuls = [], [], []
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(n.target):
            kernels.append(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__)
        elif "kprof" in str(n.target):
            opaque.append(str(n.target))
        elif "auto_functionalized" in str(n.target):  # an opaque op that mutates an input
            opaque.append(str(n.args[0]))
        elif n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            matmuls.append(n.target.__name__.split(".")[0])
    print(name, ",".join(kernels) or "-", ",".join(opaque) or "-", ",".join(matmuls) or "-")
"""

# op -> the Triton kernels its body launches, in order.
TRITON_OP_KERNELS = {
    "rms_norm_fwd": "_rms_norm_fwd_kernel",
    "rms_norm_add_fwd": "_rms_norm_fwd_kernel",
    "rms_norm_bwd": "_rms_norm_bwd_kernel,_partials_sum_kernel",
    "layer_norm_fwd": "_layer_norm_fwd_kernel",
    "layer_norm_bwd": "_layer_norm_bwd_kernel,_partials_sum_kernel",
    "swiglu_fwd": "_glu_fwd_kernel",
    "swiglu_bwd": "_glu_bwd_kernel",
    "geglu_fwd": "_glu_fwd_kernel",
    "geglu_bwd": "_glu_bwd_kernel",
    "swiglu_packed_fwd": "_glu_fwd_kernel",
    "swiglu_packed_bwd": "_glu_bwd_kernel",
    "geglu_packed_fwd": "_glu_fwd_kernel",
    "geglu_packed_bwd": "_glu_bwd_kernel",
    "bias_gelu_fwd": "_bias_gelu_fwd_kernel",
    "bias_gelu_bwd": "_bias_gelu_bwd_kernel",
    "softmax_fwd": "_softmax_fwd_rows_kernel",
    "softmax_bwd": "_softmax_bwd_rows_kernel",
    "rope_fwd": "_rope_kernel",
    "rope_bwd": "_rope_kernel",
    "cross_entropy_fwd": "_ce_fwd_kernel",
    "cross_entropy_fwd_inplace": "_ce_fwd_kernel",
    "cross_entropy_bwd": "_scale_kernel",
    "linear_cross_entropy_fwd": "_ce_fwd_kernel,_ce_fwd_kernel",
    "linear_cross_entropy_bwd": "_ce_fwd_kernel,_ce_fwd_kernel",
}
# The aten matmuls of linear+CE's chunk loop, in order, which stay aten nodes in the traced body.
# Per chunk: the logits (addmm with a bias), grad_W (mm for the first chunk, then addmm into the
# accumulator), grad_hidden (mm).
TRITON_OP_MATMULS = {
    "linear_cross_entropy_fwd": "addmm,mm,mm,addmm,addmm,mm",
    "linear_cross_entropy_bwd": "mm,mm,mm,mm,addmm,mm",
}
# With a symbolic token count linear+CE's bodies call themselves as opaque ops
# (`fused_linear_cross_entropy._symbolic_rows`): one node, no guard pinning N.
SYMBOLIC_LCE = {f"linear_cross_entropy_{d}@symbolic": f"linear_cross_entropy_{d}" for d in ("fwd", "bwd")}


# slow: a subprocess tracing every op (~5 s on 2 cores); on the GPU the Inductor test below checks it
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below compiles them with Inductor")
def test_ops_are_triton_ops_that_trace_into_their_kernels():
    got = _traced_ops()
    want = {name: (kernels, "-", TRITON_OP_MATMULS.get(name, "-")) for name, kernels in TRITON_OP_KERNELS.items()}
    for name in ("layer_norm_fwd", "layer_norm_bwd", "swiglu_packed_fwd", "swiglu_packed_bwd", "geglu_packed_fwd",
                 "geglu_packed_bwd"):  # registered as triton_ops; traced by the GPU test only (NOT_HERE)
        want[name] = ("triton_op", "-", "-")
    for name, op in SYMBOLIC_LCE.items():
        want[name] = ("-", f"kprof.{op}_dynamic.default", "-")
    assert got == want


def _traced_ops(*args: str) -> dict[str, tuple[str, ...]]:
    """TRITON_OP_SCRIPT's lines as {op or "warned": (its fields)}."""
    from aot_helpers import run_aot_script

    lines = run_aot_script(TRITON_OP_SCRIPT, *args).split("\n")
    return {name: tuple(rest) for name, *rest in (ln.split(" ") for ln in lines if ln)}


# slow: as the test above
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU registers triton_ops; this is the torch that refuses")
def test_refused_triton_ops_fall_back_to_opaque_custom_ops():
    """Where torch rejects a triton_op registration, `kernel_op` warns and registers a plain custom
    op: each op is then one opaque node after AOTAutograd (the in-place ones through
    auto_functionalized), traced from its shapes-only fake, and launches nothing itself."""
    got = _traced_ops("refuse")
    warned = set(got.pop("warned")[0].split(","))
    assert {f"kprof::{name}" for name in TRITON_OP_KERNELS} <= warned
    want = {name: ("-", f"kprof.{name}.default", "-") for name in TRITON_OP_KERNELS}
    assert got == want | {name: want[op] for name, op in SYMBOLIC_LCE.items()}


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_inductor_fullgraph_launches_the_kernels(name, dtype):
    from torch._inductor.utils import run_and_get_code

    grads, consts, call, fwd_ops, bwd_ops = _build(name, "cuda", dtype)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(*grads, *consts)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    compiled = torch.compile(call, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(lambda: _run(compiled, grads, consts))
    want = _run(call, grads, consts)
    for a, b in zip(got, want):
        assert_close(a, b, dtype=b.dtype)
    code = "\n".join(codes)
    # Inductor launches kprof's Triton kernels itself: each op's kernels appear in the generated
    # code, and no kprof:: op is called back through the dispatcher.
    for op in fwd_ops | bwd_ops:
        for kernel in TRITON_OP_KERNELS[op].split(","):
            assert kernel in code, (op, kernel)
    assert "torch.ops.kprof" not in code


@gpu
def test_inductor_linear_cross_entropy_any_token_count():
    """Token counts 6, 7, 9, 5 compile twice (static, then dynamic from the second shape on), not
    once each: with a symbolic N the op body runs as one opaque op (`_symbolic_rows`)."""
    from torch._dynamo.utils import counters

    _, _, call, _, _ = _build("linear_cross_entropy", "cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(call, backend="inductor", fullgraph=True)
    for n in (6, 7, 9, 5):
        grads, consts = _lce_inputs("cuda", torch.bfloat16)
        grads[0], consts[0] = _t(n, 16, device="cuda"), _targets(n, 37, "cuda")
        for a, b in zip(_run(compiled, grads, consts), _run(call, grads, consts)):
            assert_close(a, b, dtype=b.dtype)
    assert counters["stats"]["unique_graphs"] == 2
