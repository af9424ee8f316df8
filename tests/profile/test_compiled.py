"""Compiled models: Inductor kernels attributed and costed (kprof/analyze/compiled.py) on a
recorded trace of a compiled tiny HF Llama (tests/data/make_compiled_trace.py), graph breaks and
recompiles parsed from Dynamo's log messages and diagnosed, and the planted script end to end."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kprof.analyze import compiled, costmodel, trace
from kprof.capture.compiled import module_path
from kprof.rules.diagnoses import graph_break, recompile

DATA = Path(__file__).parent.parent / "data"
SCRIPTS = Path(__file__).parent.parent / "diagnoses_scripts"


@pytest.fixture(scope="module")
def fixture_ops():
    events = trace.load_trace(DATA / "compiled_llama_cpu.json.gz")
    kernels = json.load(gzip.open(DATA / "compiled_llama_cpu_kernels.json.gz"))
    ops = costmodel.annotate(trace.op_table(events))
    return ops, compiled.attribute(ops, kernels), kernels


def test_module_paths_from_dynamo_stack():
    assert module_path("L['args'][0].model.layers.0.mlp") == "model.layers.0.mlp"
    assert module_path("L['self'].layers[1].attn") == "layers.1.attn"
    assert module_path("L['self']._modules['model']._modules['norm']") == "model.norm"
    assert module_path("L['self']") == ""


def test_common_module_prefix():
    assert compiled.common_module(["model.layers.0.mlp.up", "model.layers.0.mlp.act"]) == "model.layers.0.mlp"
    assert compiled.common_module(["model.layers.0", "model.layers.1"]) == "model.layers"
    assert compiled.common_module(["lm_head", "model.norm"]) == ""


def test_kernel_rows_are_ops_with_their_time(fixture_ops):
    ops, _, _ = fixture_ops
    k = ops[ops["op"].map(compiled.kernel_name).notna()]
    # Two steps of one forward graph and one backward graph: each step runs both.
    assert set(k["phase"]) == {"fwd", "bwd"}
    assert (k.groupby("step").size() > 0).all()
    assert (k["device_time (us)"] > 0).all()


def test_every_kernel_attributed_below_the_root_and_costed(fixture_ops):
    _, a, _ = fixture_ops
    share = compiled.attributed_share(a)
    k = a[a["op"].map(compiled.kernel_name).notna()]
    # Each kernel fuses nodes of known modules; per step two span the whole model and sit at the
    # root: the loss backward (lm_head and the loss in LlamaForCausalLM itself) and the final
    # norm's backward fused with lm_head's gradient.
    per_step = k[k["module"] == ""].groupby("step").size()
    assert (per_step <= 2).all()
    assert 0 < share["attributed"] <= 1
    assert share["costed"] == pytest.approx(1.0)
    assert (k["flops"] >= 0).all() and (k["bytes"] > 0).all()
    assert k["fused_ops"].str.len().gt(0).all()


def test_same_kernel_twice_per_step_goes_to_each_layer(fixture_ops):
    _, a, kernels = fixture_ops
    names = {}
    for r in kernels:
        if not r["extern"]:
            names.setdefault((r["backward"], r["kernel"]), []).append(r)
    reused = [(bw, n) for (bw, n), rs in names.items()
              if len(rs) > 1 and {tuple(map(tuple, r["modules"])) for r in rs}.__len__() > 1]
    assert reused, "the fixture's two layers share at least one kernel"
    bw, name = reused[0]
    rows = a[(a["step"] == 0) & (a["op"].map(lambda o: (compiled.kernel_name(o) or (0, ""))[1]) == name)
             & (a["phase"] == ("bwd" if bw else "fwd"))]
    want = [compiled.common_module(sorted({p for p, _ in r["modules"]})) for r in names[(bw, name)]]
    assert list(rows["module"]) == want


def test_kernel_cost_reads_inputs_once_and_counts_node_flops():
    rec = {"nodes": [{"op": "aten::mul", "shapes": [[4, 8], [4, 8]], "dtypes": ["float32", "float32"],
                      "strides": [[8, 1], [8, 1]], "concrete": ["", ""], "types": ["float32", "float32"]},
                     {"op": "aten::add", "shapes": [[4, 8], [4, 8], []], "dtypes": ["float32", "float32", "Scalar"],
                      "strides": [[8, 1], [8, 1], []], "concrete": ["", "", "1"],
                      "types": ["float32", "float32", "Scalar"]}],
           "reads": [[[4, 8], "float32"], [[4, 8], "float32"]], "writes": [[[4, 8], "float32"]]}
    flops, nbytes, known = compiled.kernel_cost(rec)
    assert known
    assert flops == 2 * 32  # one mul and one add per element, the intermediate never stored
    assert nbytes == 3 * 32 * 4  # two inputs read, one output written


def test_extern_matmuls_take_their_linear(fixture_ops):
    _, a, _ = fixture_ops
    mm = a[(a["op"] == "aten::mm") & (a["phase"] == "fwd")]
    assert mm["module"].str.endswith(("_proj", "lm_head")).all()
    assert mm["module_class"].eq("Linear").all()


# Dynamo's messages as torch 2.13 logs them (the planted script's break and recompile, cut).
BREAK = ("Graph break in user code at /w/compile_break.py:22\n"
         "Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):\n\n"
         "Unsupported Tensor.item() call with capture_scalar_outputs=False\n"
         "  Explanation: Dynamo does not support tracing `Tensor.item()` with config.capture_scalar_outputs=False.\n"
         "  Hint: Set `torch._dynamo.config.capture_scalar_outputs = True` to include these operations.\n")
BREAK_DUP = "Graph break (user stack suppressed due to duplicate graph break) in user code at /w/compile_break.py:22\n" \
            + BREAK.split("\n", 1)[1]
RECOMPILE = ("Recompiling function torch_dynamo_resume_in_forward_at_22 in /w/compile_break.py:22\n"
             "    triggered by the following guard failure(s):\n"
             "    - 1/0: scale == 1.0                        # return self.b(y) * scale  # w/compile_break.py:24 in "
             "torch_dynamo_resume_in_forward_at_22\n")
SHAPE = ("Recompiling function forward in /w/compile_break.py:20\n    triggered by the following guard failure(s):\n"
         "    - 0/0: tensor 'x' size mismatch at index 0. expected 4, actual 6\n")


def test_compile_events_one_per_place():
    ev = compiled.compile_events([{"kind": "graph_break", "message": BREAK},
                                  {"kind": "graph_break", "message": BREAK_DUP},
                                  {"kind": "recompile", "message": RECOMPILE},
                                  {"kind": "recompile", "message": SHAPE}])
    (b,) = ev["graph_breaks"]
    assert (b["file"], b["line"], b["count"]) == ("/w/compile_break.py", 22, 2)
    assert b["reason"] == "Unsupported Tensor.item() call with capture_scalar_outputs=False"
    assert "capture_scalar_outputs" in b["hints"][0]
    scalar, shape = ev["recompiles"]
    assert (scalar["guard"], scalar["guard_line"]) == ("scale == 1.0", 24)
    assert (shape["function"], shape["line"], shape["guard_line"]) == ("forward", 20, None)


def test_diagnoses_point_at_the_lines():
    summary = {"compile": compiled.compile_events([{"kind": "graph_break", "message": BREAK},
                                                   {"kind": "recompile", "message": RECOMPILE},
                                                   {"kind": "recompile", "message": SHAPE}])}
    (gb,) = graph_break.find(None, summary)
    assert gb.where == "compile_break.py:22" and "item()" in gb.evidence
    rc = recompile.find(None, summary)
    assert [f.where for f in rc] == ["compile_break.py:24 (torch_dynamo_resume_in_forward_at_22)",
                                     "compile_break.py:20 (forward)"]
    assert "tensor" in rc[0].how and "mark_dynamic" in rc[1].how
    assert graph_break.find(None, {}) == [] and recompile.find(None, {"compile": None}) == []


def _line(tag: str) -> int:
    lines = (SCRIPTS / "compile_break.py").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if f"kprof-test: {tag}" in ln)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from kprof.analyze.profile import profile_script
    from kprof.rules.diagnoses import diagnose

    run = profile_script(str(SCRIPTS / "compile_break.py"), ["--iters", "8"], warmup=1, steps=1,
                         out_root=tmp_path_factory.mktemp("runs"))
    return run, diagnose(run)


@pytest.mark.slow
def test_planted_script_one_break_at_its_line(planted):
    run, d = planted
    gb = d[d["id"] == "graph_break"]
    assert len(gb) == 1 and gb.iloc[0]["source"].endswith(f"compile_break.py:{_line('graph-break')}")
    assert run.summary["compile"]["kernel_records"] > 0
    k = run.ops[run.ops["op"].map(compiled.kernel_name).notna()]
    assert len(k) and set(k["module"]) <= {"a", "b", ""}


@pytest.mark.slow
def test_planted_script_one_recompile_at_its_line(planted):
    _, d = planted
    rc = d[d["id"] == "recompile"]
    assert len(rc) == 1 and rc.iloc[0]["source"].endswith(f"compile_break.py:{_line('recompile')}")


@pytest.mark.gpu
def test_gpu_compiled_tiny_llama_kernels_attributed(tmp_path):
    """On CUDA every Inductor kernel is a Triton launch range named after the kernel; nearly all
    of their time must land below the root module, costed."""
    from kprof.analyze.profile import profile_script

    script = tmp_path / "compiled_llama.py"
    script.write_text(
        "import torch, transformers\n"
        "cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,\n"
        "    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)\n"
        "torch.manual_seed(0)\n"
        "model = torch.compile(transformers.LlamaForCausalLM(cfg).cuda())\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)\n"
        "ids = torch.randint(0, 512, (4, 128), device='cuda')\n"
        "for _ in range(20):\n"
        "    model(input_ids=ids, labels=ids).loss.backward()\n"
        "    opt.step(); opt.zero_grad(set_to_none=True)\n")
    run = profile_script(str(script), [], warmup=3, steps=3, out_root=tmp_path / "runs")
    att = run.summary["compile"]["attribution"]
    k = run.ops[run.ops["op"].str.startswith("triton_")]
    where = k.groupby("module")["device_time (us)"].sum().sort_values().tail(12).to_string() if len(k) else "no triton_ rows"
    assert att["kernel_us"] > 0, att
    assert att["attributed"] >= 0.95, (att, where)
    assert att["costed"] >= 0.95, (att, where)
    assert k["module"].str.startswith("model.layers.").any(), where
