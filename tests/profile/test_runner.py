"""kprof.capture.runner on the planted scripts in tests/profile/scripts (tiny models, a few steps each).

The scripts pick CUDA when it exists, so the same tests check a GPU run on the H200; the
`gpu`-marked tests at the end check what only a GPU run has (CUDA events, kernels, real syncs).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optim_module

from kprof.capture.runner import (
    AUTO_FORWARD_AFTER_CALLS,
    MODULE_RANGE_PREFIX,
    PARTIAL_STEP_RANGE_PREFIX,
    PROFILER_WARMUP_STEPS,
    SHAPES_STEP_RANGE,
    SHAPES_STEPS,
    STEP_RANGE_PREFIX,
    RunConfig,
    run_script,
)
from kprof.errors import KprofError

SCRIPTS = Path(__file__).parent / "scripts"
TINYLM_PATHS = {"": "TinyLM", "embed": "Embedding", "mlp": "MLP", "mlp.up": "Linear", "mlp.act": "GELU", "mlp.down": "Linear", "head": "Linear"}
TOKENS = 4 * 8  # tinylm.BATCH * tinylm.SEQ


def run(name: str, *argv: str, tmp_path: Path, **cfg):
    cfg.setdefault("warmup", 1)
    cfg.setdefault("steps", 3)
    return run_script(str(SCRIPTS / name), list(argv), RunConfig(trace_dir=str(tmp_path), **cfg))


def kprof_ranges(trace_path: str) -> list[dict]:
    """The CPU-side kprof ranges (record_function user annotations) of an exported trace, outside
    the shapes step (the profiler warm-up step merged into the trace for its shapes)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ranges = [e for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith("kprof.")]
    shapes = [e for e in ranges if e["name"] == SHAPES_STEP_RANGE]
    return [e for e in ranges if e["name"] != SHAPES_STEP_RANGE
            and not any(w["ts"] <= e["ts"] <= w["ts"] + w["dur"] for w in shapes)]


def line_of(script: str, marker: str) -> int:
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def split_module_range(name: str) -> tuple[str, str]:
    return tuple(name[len(MODULE_RANGE_PREFIX):].rsplit(":", 1))  # type: ignore[return-value]


# --------------------------------------------------------------------------- training loops
def test_training_loop_steps_ranges_losses_and_cleanup(tmp_path):
    hooks_before = (
        dict(torch.nn.modules.module._global_forward_hooks),
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(optim_module._global_optimizer_post_hooks),
    )
    backward, opt_init, argv, path = torch.autograd.backward, torch.optim.Optimizer.__init__, list(sys.argv), list(sys.path)

    r = run("train_mlp.py", tmp_path=tmp_path, warmup=2, steps=3)

    assert r.status == "stopped" and r.exit_code == 0 and r.error is None
    assert "stopped the script" in r.message
    assert r.step_definition == "optimizer.step (AdamW)"
    assert len(r.step_times_ms) == 3 and len(r.profiled_step_times_ms) == 3
    assert all(t > 0 for t in r.step_times_ms + r.profiled_step_times_ms)
    assert r.steps_recorded == 3 and r.steps_before_timing == 2
    assert r.module_classes == TINYLM_PATHS
    assert r.tokens_per_step == TOKENS
    assert r.peak_memory_bytes and r.peak_memory_bytes > 0 and r.peak_memory_label
    assert r.device["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert Path(r.trace_path).parent == tmp_path

    # Steps run until the stop: 2 warm-up + 3 timed + 1 profiler warm-up + 3 recorded, and the
    # losses are the ones the same loop computes without kprof.
    n_steps = 2 + 3 + PROFILER_WARMUP_STEPS + 3 + SHAPES_STEPS
    sys.path.insert(0, str(SCRIPTS))
    try:
        from tinylm import DEVICE, TinyLM, batch
    finally:
        sys.path.remove(str(SCRIPTS))
    torch.manual_seed(0)
    model = TinyLM().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for step in range(n_steps):
        ids, labels = batch(step)
        loss = model(input_ids=ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(loss.item())
    # Same ops in the same order; on CUDA the embedding backward's atomics may reorder sums.
    assert r.losses == pytest.approx(expected, rel=1e-5)

    ranges = kprof_ranges(r.trace_path)
    steps = sorted((e for e in ranges if e["name"].startswith(STEP_RANGE_PREFIX)), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == [f"{STEP_RANGE_PREFIX}{i}" for i in range(3)]
    modules = [e for e in ranges if e["name"].startswith(MODULE_RANGE_PREFIX)]
    # Every module forward once per recorded step, each inside a step range.
    counts: dict[tuple[str, str], int] = {}
    for e in modules:
        key = split_module_range(e["name"])
        counts[key] = counts.get(key, 0) + 1
        assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] for s in steps), e["name"]
    assert counts == {(p, c): 3 for p, c in TINYLM_PATHS.items()}
    # Nesting: mlp.up's range sits inside mlp's range of the same step.
    up = next(e for e in modules if split_module_range(e["name"])[0] == "mlp.up")
    assert any(
        split_module_range(e["name"])[0] == "mlp" and e["ts"] <= up["ts"] and up["ts"] + up["dur"] <= e["ts"] + e["dur"]
        for e in modules
    )

    # Everything kprof installed is gone.
    assert (
        dict(torch.nn.modules.module._global_forward_hooks),
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        dict(optim_module._global_optimizer_post_hooks),
    ) == hooks_before
    assert torch.autograd.backward is backward and torch.optim.Optimizer.__init__ is opt_init
    assert sys.argv == argv and sys.path == path
    assert torch._C._len_torch_function_stack() == 0


def test_item_sync_is_attributed_to_its_line_and_second_root_gets_a_prefix(tmp_path):
    r = run("train_item.py", tmp_path=tmp_path, warmup=1, steps=2)
    assert r.status == "stopped"
    item = [s for s in r.syncs if s["kind"] == "Tensor.item"]
    assert len(item) == 1, r.syncs
    s = item[0]
    assert s["file"] == str(SCRIPTS / "train_item.py")
    assert s["line"] == line_of("train_item.py", "kprof-test: item-sync")
    assert "loss.item()" in s["code"] and s["function"] == "<module>"
    # The detector watches the profiler warm-up step (0), the recorded steps (1, 2: a sync every
    # N steps is seen only if enough steps are watched) and the shapes step (3), never the timed ones.
    assert s["count"] == 4 and s["steps"] == [0, 1, 2, 3] and r.sync_steps == 4
    assert s["would_sync_on_gpu"] is (not torch.cuda.is_available())
    # AdamW's own .item() on its host-side step counter is not the user's sync.
    assert not any("opt.step()" in x["code"] for x in r.syncs)
    assert r.tokens_per_step == TOKENS  # from the first 2-D integer tensor argument
    # The criterion is a second root: its path is prefixed with its class.
    assert r.module_classes["CrossEntropyLoss"] == "CrossEntropyLoss"
    names = {e["name"] for e in kprof_ranges(r.trace_path)}
    assert f"{MODULE_RANGE_PREFIX}CrossEntropyLoss:CrossEntropyLoss" in names


def test_except_exception_does_not_swallow_the_stop(tmp_path):
    r = run("train_swallow.py", tmp_path=tmp_path, warmup=0, steps=2)
    assert r.status == "stopped", (r.status, r.error)
    assert r.steps_recorded == 2 and r.exit_code == 0


def test_script_too_short_returns_what_was_recorded(tmp_path):
    # The first optimizer step ends the one warm-up step; optimizer steps 2-4 end the timed
    # steps, 5 the profiler warm-up, 6 recorded step #0. Step #1 would end at step 7: never.
    r = run("train_mlp.py", "--iters", "6", tmp_path=tmp_path, warmup=1, steps=3)
    assert r.status == "completed" and r.exit_code == 0
    assert r.steps_recorded == 1
    assert len(r.step_times_ms) == 3 and len(r.profiled_step_times_ms) == 1
    assert "ended after 1 of 3 recorded steps" in r.message
    assert len(r.losses) == 6
    # The unfinished step is kept out of the trace's step ranges.
    names = {e["name"] for e in kprof_ranges(r.trace_path)}
    assert f"{STEP_RANGE_PREFIX}0" in names and f"{STEP_RANGE_PREFIX}1" not in names
    assert f"{PARTIAL_STEP_RANGE_PREFIX}1" in names


def test_run_to_end_keeps_all_losses(tmp_path):
    r = run("train_mlp.py", "--iters", "12", tmp_path=tmp_path, warmup=1, steps=2, run_to_end=True)
    assert r.status == "completed" and r.steps_recorded == 2
    assert len(r.losses) == 12 and all(l == l for l in r.losses)  # no NaN: every step had a loss


def test_grad_scaler_losses_are_unscaled(tmp_path):
    r = run("train_amp.py", tmp_path=tmp_path, warmup=1, steps=2)
    assert r.status == "stopped" and r.step_definition == "optimizer.step (AdamW)"
    # backward() sees loss * 1024; the recorded loss is the one before scaling: a random
    # 64-way classifier starts near ln(64) = 4.16.
    # 1 warm-up + 2 timed + 1 profiler warm-up + 2 recorded + 1 shapes step
    assert len(r.losses) == 7 and all(3.0 < l < 5.5 for l in r.losses), r.losses


def test_forward_step_mode_on_a_training_script(tmp_path):
    r = run("train_mlp.py", tmp_path=tmp_path, warmup=1, steps=2, step_mode="forward")
    assert r.status == "stopped"
    assert r.step_definition == "outermost forward (TinyLM)"
    assert r.steps_recorded == 2 and r.tokens_per_step == TOKENS


# --------------------------------------------------------------------------- inference loops
def test_inference_loop_is_stepped_by_the_outermost_forward(tmp_path):
    r = run("inference.py", tmp_path=tmp_path, warmup=1, steps=2)
    assert r.status == "stopped"
    assert r.step_definition == "outermost forward (TinyLM)"
    # Auto mode waits AUTO_FORWARD_AFTER_CALLS calls for an optimizer step before deciding.
    assert r.steps_before_timing == AUTO_FORWARD_AFTER_CALLS
    assert r.steps_recorded == 2 and len(r.step_times_ms) == 2
    assert r.losses == [] and r.tokens_per_step == TOKENS
    counts: dict[str, int] = {}
    for e in kprof_ranges(r.trace_path):
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    assert counts[f"{MODULE_RANGE_PREFIX}:TinyLM"] == 2 and counts[f"{MODULE_RANGE_PREFIX}mlp.down:Linear"] == 2


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_evaluation_before_training_ends_up_in_optimizer_steps(tmp_path, optimizer_first):
    modes = []
    r = run_script(
        str(SCRIPTS / "eval_then_train.py"),
        ["--optimizer-first"] if optimizer_first else [],
        RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)),
        progress=lambda event, **info: modes.append(info["step_definition"]) if event == "mode" else None,
    )
    assert r.status == "stopped" and r.step_definition == "optimizer.step (AdamW)"
    if optimizer_first:
        # An optimizer exists: 20 forwards are far below the wait for its first step.
        assert modes == ["optimizer.step (AdamW)"] and not r.warnings
    else:
        # No optimizer yet: after 16 forwards kprof guesses forward steps and starts measuring;
        # the first optimizer step overturns the guess and the measurement starts over.
        assert modes == ["outermost forward (TinyLM)", "optimizer.step (AdamW)"]
        assert any("switched from forward steps to optimizer steps" in w for w in r.warnings)
    assert r.steps_recorded == 2 and len(r.step_times_ms) == 2
    steps = sorted(e["name"] for e in kprof_ranges(r.trace_path) if e["name"].startswith(STEP_RANGE_PREFIX))
    assert steps == [f"{STEP_RANGE_PREFIX}0", f"{STEP_RANGE_PREFIX}1"]  # only the optimizer-step profile


def test_inference_with_optimizer_mode_records_nothing(tmp_path):
    r = run("inference.py", "--iters", "10", tmp_path=tmp_path, step_mode="optimizer")
    assert r.status == "completed" and r.steps_recorded == 0 and r.trace_path is None
    assert r.step_definition == "optimizer.step (not called)"
    assert "ended after 0 of 3 recorded steps" in r.message


# --------------------------------------------------------------------------- errors and exits
def test_script_error_keeps_traceback_and_partial_profile(tmp_path):
    # warmup 1 -> the first optimizer step counts as warm-up; recorded steps end at optimizer
    # steps 6 and 7; the script raises right after the 7th, inside recorded step #2.
    r = run("train_raises.py", "--raise-at", "7", tmp_path=tmp_path, warmup=1, steps=3)
    assert r.status == "error" and r.exit_code == 1
    assert "ValueError: planted failure at step 6" in r.error
    assert f'"{SCRIPTS / "train_raises.py"}", line {line_of("train_raises.py", "kprof-test: raise")}' in r.error
    assert "runpy" not in r.error and os.path.join("kprof", "runner.py") not in r.error
    assert r.steps_recorded == 2 and r.trace_path is not None
    names = {e["name"] for e in kprof_ranges(r.trace_path)}
    assert {f"{STEP_RANGE_PREFIX}0", f"{STEP_RANGE_PREFIX}1", f"{PARTIAL_STEP_RANGE_PREFIX}2"} <= names
    assert f"{STEP_RANGE_PREFIX}2" not in names


def test_keyboard_interrupt_exports_what_was_collected(tmp_path):
    r = run("train_raises.py", "--interrupt-at", "6", tmp_path=tmp_path, warmup=1, steps=3)
    assert r.status == "interrupted" and r.exit_code == 130
    assert r.steps_recorded == 1 and r.trace_path is not None
    assert torch._C._len_torch_function_stack() == 0  # the sync detector was removed


def test_sys_exit_zero_is_a_normal_end(tmp_path):
    r = run("exit_zero.py", tmp_path=tmp_path)
    assert r.status == "completed" and r.exit_code == 0 and r.error is None
    assert r.steps_recorded == 0 and r.trace_path is None
    assert len(r.losses) == 3  # the script's three optimizer steps, even though too few to time


def test_sys_exit_nonzero_is_an_error_with_that_code(tmp_path):
    r = run("exit_three.py", tmp_path=tmp_path)
    assert r.status == "error" and r.exit_code == 3
    assert r.step_definition.startswith("none")


def test_script_sees_its_own_argv_path_and_name(tmp_path):
    out = tmp_path / "seen.json"
    r = run("argv_echo.py", str(out), "--flag", tmp_path=tmp_path)
    assert r.status == "completed"
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(SCRIPTS / "argv_echo.py"), str(out), "--flag"]
    assert seen["path0"] == str(SCRIPTS) and seen["name"] == "__main__"


@pytest.mark.parametrize(
    "cfg, message",
    [
        (dict(steps=0), "--steps must be a positive integer"),
        (dict(warmup=-1), "--warmup must be 0 or more"),
        (dict(step_mode="epoch"), "unknown step mode"),
    ],
)
def test_bad_config_is_a_usage_error(cfg, message, tmp_path):
    with pytest.raises(KprofError, match=message) as e:
        run_script(str(SCRIPTS / "train_mlp.py"), [], RunConfig(**cfg))
    assert e.value.exit_code == 2


def test_missing_script_and_folder_are_usage_errors(tmp_path):
    with pytest.raises(KprofError, match="script not found") as e:
        run_script(str(tmp_path / "nope.py"), [])
    assert e.value.exit_code == 2
    with pytest.raises(KprofError, match="is a folder") as e:
        run_script(str(tmp_path), [])
    assert e.value.exit_code == 2


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can read any file")
def test_unreadable_script_is_a_usage_error(tmp_path):
    script = tmp_path / "secret.py"
    script.write_text("print('hi')\n")
    script.chmod(0)
    with pytest.raises(KprofError, match="cannot read script") as e:
        run_script(str(script), [])
    assert e.value.exit_code == 2


def test_syntax_error_is_reported_as_a_script_error(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def f(:\n")
    r = run_script(str(script), [], RunConfig())
    assert r.status == "error" and r.exit_code == 1 and "SyntaxError" in r.error


# --------------------------------------------------------------------------- hooks for kprof apply / the CLI
def test_on_root_module_runs_once_before_the_first_forward_and_can_patch(tmp_path):
    calls = []

    def patch(root: nn.Module) -> None:
        calls.append(type(root).__name__)
        if type(root).__name__ == "TinyLM":
            root.mlp.act = nn.ReLU()  # what `kprof apply` does, in miniature

    r = run("train_item.py", tmp_path=tmp_path, warmup=1, steps=2, on_root_module=patch)
    assert calls == ["TinyLM", "CrossEntropyLoss"]
    assert r.module_classes["mlp.act"] == "ReLU"  # paths are taken after the patch
    assert f"{MODULE_RANGE_PREFIX}mlp.act:ReLU" in {e["name"] for e in kprof_ranges(r.trace_path)}


def test_on_root_module_failure_is_raised_after_cleanup(tmp_path):
    def boom(root):
        raise KprofError("cannot patch this model")

    with pytest.raises(KprofError, match="cannot patch"):
        run("train_swallow.py", tmp_path=tmp_path, on_root_module=boom)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


def test_progress_reports_every_boundary_in_order(tmp_path):
    events = []
    r = run_script(
        str(SCRIPTS / "train_mlp.py"),
        [],
        RunConfig(warmup=2, steps=2, trace_dir=str(tmp_path)),
        progress=lambda event, **info: events.append((event, info)),
    )
    assert r.status == "stopped"
    assert events[0] == ("mode", {"step_definition": "optimizer.step (AdamW)", "reason": "optimizer.step() was called"})
    phases = [info["phase"] for ev, info in events if ev == "step"]
    # The first optimizer step ends warm-up step 0; then 1 more warm-up, 2 timed, 1 profiler
    # warm-up, 2 recorded, done.
    assert phases == ["warmup", "timing", "timing", "profiler-warmup", "profiling", "profiling", "done"]
    assert events[-1][0] == "export" and events[-1][1]["path"] == r.trace_path


def test_a_raising_progress_callback_is_dropped(tmp_path):
    def bad(event, **info):
        raise RuntimeError("display broke")

    r = run_script(str(SCRIPTS / "train_mlp.py"), [], RunConfig(warmup=0, steps=1, trace_dir=str(tmp_path)), progress=bad)
    assert r.status == "stopped" and any("display broke" in w for w in r.warnings)


def test_hooks_are_off_during_the_timed_steps_only(tmp_path):
    # Global module hooks slow every module call; the timed steps must run without them.
    from torch.nn.modules import module as nn_module

    seen = []

    def progress(event, **info):
        if event == "step":
            seen.append((info["phase"], bool(nn_module._global_forward_pre_hooks)))

    for script in ("train_mlp.py", "inference.py"):  # optimizer steps, forward steps
        seen.clear()
        r = run_script(str(SCRIPTS / script), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)), progress=progress)
        assert r.status == "stopped" and len(r.step_times_ms) == 2 and r.steps_recorded == 2
        hooked = {}
        for phase, on in seen:
            hooked.setdefault(phase, set()).add(on)
        # (inference.py has no "warmup" phase: auto mode's 16 deciding calls already warmed it)
        assert hooked["timing"] == {False} and hooked["profiling"] == {True}, (script, seen)
        assert hooked["profiler-warmup"] == {True} and hooked.get("warmup", {True}) == {True}, (script, seen)


def test_hooks_are_off_during_timing_after_an_earlier_compile_in_the_process(tmp_path):
    # A frame compiled before the run (another test, a notebook cell) must not keep the hooks on:
    # only what the script compiles under kprof's hooks would recompile when they are removed.
    from torch.nn.modules import module as nn_module

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # eager: no C++ compiler
    seen = []

    def progress(event, **info):
        if event == "step":
            seen.append((info["phase"], bool(nn_module._global_forward_pre_hooks)))

    r = run_script(str(SCRIPTS / "train_mlp.py"), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)), progress=progress)
    assert r.status == "stopped"
    assert {on for phase, on in seen if phase == "timing"} == {False}, seen
    assert {on for phase, on in seen if phase == "profiling"} == {True}, seen


def test_odd_modules_give_well_nested_ranges(tmp_path):
    r = run("odd_modules.py", tmp_path=tmp_path, warmup=1, steps=3)
    assert r.status == "stopped" and not r.warnings, (r.error, r.warnings)
    assert r.module_classes["<unregistered Tanh>"] == "Tanh"  # built inside forward
    ranges = kprof_ranges(r.trace_path)
    steps = [e for e in ranges if e["name"].startswith(STEP_RANGE_PREFIX)]
    modules = [e for e in ranges if e["name"].startswith(MODULE_RANGE_PREFIX)]
    count = {}
    for e in modules:
        count[split_module_range(e["name"])[0]] = count.get(split_module_range(e["name"])[0], 0) + 1
    # Recursive(3) calls itself twice per forward: three ranges for it and for its Linear.
    assert count["rec"] == count["rec.lin"] == 3 * count["flaky"] > 0
    assert count["<unregistered Tanh>"] == count["flaky"]  # the raising child still got its range
    # Ranges on one thread never partly overlap (the user hook raising every 3rd call of
    # `shared`, and Flaky raising inside its parent, must not leave ranges open).
    for a in modules:
        assert any(s["ts"] <= a["ts"] and a["ts"] + a["dur"] <= s["ts"] + s["dur"] for s in steps)
        for b in modules:
            if a is b or a["tid"] != b["tid"]:
                continue
            a0, a1, b0, b1 = a["ts"], a["ts"] + a["dur"], b["ts"], b["ts"] + b["dur"]
            assert a1 <= b0 or b1 <= a0 or (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1), (a["name"], b["name"])


def test_a_root_rebuilt_every_step_keeps_one_path(tmp_path):
    calls = []
    r = run("inline_loss.py", tmp_path=tmp_path, warmup=1, steps=2, on_root_module=lambda m: calls.append(type(m).__name__))
    assert r.status == "stopped"
    assert r.module_classes == {"": "Linear", "CrossEntropyLoss": "CrossEntropyLoss"}
    names = [e["name"] for e in kprof_ranges(r.trace_path)]
    assert names.count(f"{MODULE_RANGE_PREFIX}CrossEntropyLoss:CrossEntropyLoss") == 2
    # Each new loss object is a root of its own (kprof apply sees every one), under one path.
    assert calls[0] == "Linear" and set(calls[1:]) == {"CrossEntropyLoss"} and len(calls) > 2


@pytest.mark.slow
def test_torch_compile_model_does_not_crash(tmp_path):
    # Dynamo tracing takes ~10 s on a busy 2-core CPU; backend "eager" needs no C++ compiler.
    from torch._dynamo.utils import counters  # Dynamo's own statistics (internal, stable since 2.0)

    graphs = []

    def progress(event, **info):
        if event == "step":
            graphs.append((info["phase"], counters["stats"]["unique_graphs"]))

    r = run_script(str(SCRIPTS / "train_compiled.py"), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)), progress=progress)
    assert r.status == "stopped", r.error
    # kprof's sync detector (a torch function mode) stays off for compiled code, so nothing
    # recompiles after the warm-up: one graph count through the timed and recorded steps.
    # (counts are read at step starts: "profiler-warmup" is the count when timing ended)
    timed = {n for phase, n in graphs if phase in ("timing", "profiler-warmup")}
    recorded = {n for phase, n in graphs if phase in ("profiling", "done")}
    assert len(timed | recorded) == 1, graphs
    assert r.step_definition == "optimizer.step (AdamW)" and r.steps_recorded == 2
    # The compiled wrapper and the model share the root path; submodules run inside the
    # compiled graph, where hooks do not fire, so only the root has ranges.
    names = [e["name"] for e in kprof_ranges(r.trace_path)]
    assert names.count(f"{MODULE_RANGE_PREFIX}:TinyLM") == 2
    assert r.module_classes[""] == "TinyLM"
    assert len(r.warnings) == 1 and "host-sync detection by source line skipped" in r.warnings[0]


@pytest.mark.slow
def test_hugging_face_llama_paths_tokens_and_no_false_syncs(tmp_path):
    pytest.importorskip("transformers")
    r = run("train_hf_llama.py", tmp_path=tmp_path, warmup=1, steps=2)
    assert r.status == "stopped" and not r.warnings, (r.error, r.warnings)
    assert r.module_classes[""] == "LlamaForCausalLM"
    assert r.module_classes["model.layers.1.mlp.down_proj"] == "Linear"
    assert r.tokens_per_step == 2 * 16  # input_ids=(2, 16) passed as a keyword
    names = [e["name"] for e in kprof_ranges(r.trace_path)]
    assert names.count(f"{MODULE_RANGE_PREFIX}model.layers.0.self_attn.q_proj:Linear") == 2
    if not torch.cuda.is_available():
        # transformers' own host-side bookkeeping is not blamed on the script on a CPU run.
        assert r.syncs == []


# --------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpu_run_times_with_cuda_events_and_sees_kernels_and_real_syncs(tmp_path):
    r = run("train_item.py", tmp_path=tmp_path, warmup=2, steps=3)
    assert r.device["type"] == "cuda" and r.device["sm_count"] > 0
    assert r.peak_memory_label.startswith("torch.cuda.max_memory_allocated") and r.peak_memory_bytes > 0
    item = [s for s in r.syncs if s["kind"] == "Tensor.item"]
    assert len(item) == 1 and item[0]["real"] and not item[0]["would_sync_on_gpu"]
    # watched: the profiler warm-up step, the 3 recorded steps and the shapes step
    assert item[0]["count"] == 5 and item[0]["steps"] == [0, 1, 2, 3, 4]
    with open(r.trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernels in the trace"
    # What the analysis reads: three step ranges, each with kernels launched in it. (Kineto's
    # `gpu_user_annotation` copies of the step ranges are no contract: it derives them from the
    # innermost user range around each launch, and the module and optimizer ranges are inner;
    # the H200 run had one for three steps.)
    from kprof.analyze import trace

    ev = trace.load_trace(r.trace_path)
    assert ev.device_type == "cuda" and list(ev.steps["step"]) == [0, 1, 2]
    k = trace.kernel_table(ev)
    assert sorted(k["step"].unique()) == [0, 1, 2]
    ops = trace.op_table(ev)
    assert sorted(ops["step"].unique()) == [0, 1, 2]
    # every Linear's forward matmul is attributed to its module in every recorded step
    mm = ops[(ops["phase"] == "fwd") & ops["op"].isin(["aten::addmm", "aten::mm"])]
    assert (mm["module"] != trace.UNATTRIBUTED).all() and set(mm["step"]) == {0, 1, 2}


@pytest.mark.gpu
def test_gpu_cpu_tensor_item_is_not_a_sync(tmp_path):
    script = tmp_path / "cpu_item.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(4, 4).cuda()\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(12):\n"
        "    m(torch.randn(2, 4, device='cuda')).sum().backward()\n"
        "    opt.step()\n"
        "    torch.ones(()).item()\n"
    )
    r = run_script(str(script), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)))
    assert r.status == "stopped" and r.syncs == []


@pytest.mark.gpu
def test_gpu_grad_scaler_step_is_a_real_sync_at_the_users_line(tmp_path):
    # GradScaler.step reads found_inf back (`.item()` inside torch.amp): blamed on the call site.
    r = run("train_amp.py", tmp_path=tmp_path, warmup=1, steps=2)
    sites = [s for s in r.syncs if s["line"] == line_of("train_amp.py", "kprof-test: scaler-step")]
    assert sites and all(s["real"] for s in sites) and sites[0]["count"] >= 2, r.syncs


# --------------------------------------------------------------------------- kprof.capture.nvtx
def test_nvtx_falls_back_when_the_package_is_missing(monkeypatch):
    import importlib

    import kprof.capture.nvtx as knvtx

    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` now raises ImportError
    try:
        fresh = importlib.reload(knvtx)
        expected = "torch.cuda.nvtx" if torch.cuda.is_available() else "none"
        assert fresh.BACKEND == expected
        with fresh.annotate("kprof test range"):
            fresh.range_push("inner")
            fresh.range_pop()
    finally:
        monkeypatch.undo()
        importlib.reload(knvtx)
    assert knvtx.BACKEND in ("nvtx", "torch.cuda.nvtx", "none")


def test_runs_in_one_process_do_not_leak_into_each_other(tmp_path):
    # H200, 2026-11-29: a planted script set TF32 and its helper module kept the first run's
    # device; the next in-process runs (tests, `kprof apply`) inherited both.
    (tmp_path / "helper_mod.py").write_text("import sys\nDEVICE = sys.argv[-1]\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, helper_mod\n"
        "torch.backends.cuda.matmul.allow_tf32 = True\n"
        "torch.set_default_dtype(torch.float64)\n"
        "m = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print('device', helper_mod.DEVICE)\n"
    )
    from kprof.capture.runner import RunConfig, run_script

    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_default_dtype())
    for arg in ("first", "second"):
        r = run_script(str(script), [arg], RunConfig(warmup=1, steps=1, trace_dir=str(tmp_path)))
        assert r.status in ("completed", "stopped") and r.steps_recorded == 1, r.error  # stopped: all steps recorded
        assert "helper_mod" not in sys.modules  # imported afresh by the next run
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_default_dtype()) == before


def test_modules_called_while_the_compiler_traces_are_never_taken_for_roots(tmp_path):
    # AOTAutograd traces the backward graph at the first backward and calls its own GraphModules
    # under a proxy mode; the root hook once took one for a new root, and `kprof apply --compare`
    # wrapped it (the GPT example, kprof + torch.compile on the H200, 2026-11-29: Inductor
    # RecursionError; reproduced on the CPU with TRITON_INTERPRET=1). make_fx is the same tracer.
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "m = torch.nn.Linear(4, 1)\n"
        "traced_only = torch.nn.Linear(4, 4)  # called only under the tracer\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    make_fx(lambda x: traced_only(x))(torch.randn(2, 4))\n"
        "    m(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    from kprof.capture.runner import RunConfig, run_script

    roots = []
    r = run_script(str(script), [], RunConfig(warmup=1, steps=1, trace_dir=str(tmp_path), on_root_module=roots.append))
    assert r.steps_recorded == 1, r.error
    assert [type(x).__name__ for x in roots] == ["Linear"] and roots[0].out_features == 1


_CPU_ONLY = """
import torch
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(12):
    loss = model(torch.randn(4, 8, device="cpu")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


# slow on a CPU: faking CUDA makes the profiler log a C++ warning with a stack trace for every op
# (~5 s); the GPU run (benchmarks/gpu_run.sh runs the slow cases) checks it for real
@pytest.mark.slow
def test_cpu_only_script_on_a_cuda_machine_reports_rss_peak(tmp_path, monkeypatch):
    """A script that never touches CUDA on a machine that has it: the peak is the process RSS,
    labelled so, not missing (found on the H200: `--compare` of a CPU toy script had no peak)."""
    faked = not torch.cuda.is_available()
    if faked:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what the runner sees on a GPU host
    script = tmp_path / "cpu_only.py"
    script.write_text(_CPU_ONLY)
    try:
        r = run_script(str(script), [], RunConfig(trace_dir=str(tmp_path), warmup=1, steps=2))
    finally:
        if faked:
            # Profiling CUDA on a machine without it leaves the profiler asking for CUDA events in
            # its next session in this process, which then logs a C++ warning with a stack trace
            # for every op (30 s in the next test's run); an empty CPU-only session clears it.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                pass
    assert r.status == "stopped" and r.steps_recorded == 2, r.message
    assert r.peak_memory_bytes and r.peak_memory_bytes > 10 * 2**20
    assert "RSS" in r.peak_memory_label


def test_shapes_on_one_step_times_on_the_others(tmp_path):
    """One step after the recorded ones is recorded with shapes and merged into the trace under
    SHAPES_STEP_RANGE; the recorded steps are timed without shapes. shapes_every_step records
    them on every recorded step instead, with no extra step."""
    r = run("train_mlp.py", tmp_path=tmp_path, warmup=1, steps=2)
    assert r.status == "stopped" and r.steps_recorded == 2 and r.shapes_recorded == "shapes step"
    with open(r.trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    window = next(e for e in events if e.get("name") == SHAPES_STEP_RANGE)
    steps = [e for e in events if e.get("name", "").startswith(STEP_RANGE_PREFIX)]
    assert len(steps) == 2 and all(s["ts"] + s["dur"] <= window["ts"] for s in steps)
    ops = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::addmm"]
    inside = [e for e in ops if window["ts"] <= e["ts"] <= window["ts"] + window["dur"]]
    timed = [e for e in ops if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
    assert inside and all("Input Dims" in e["args"] for e in inside)
    assert timed and not any("Input Dims" in e["args"] for e in timed)
    # no trace files left behind but the run's own
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(r.trace_path).name]

    r = run("train_mlp.py", tmp_path=tmp_path / "every", warmup=1, steps=2, shapes_every_step=True)
    assert r.shapes_recorded == "every step"
    with open(r.trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    assert not any(e.get("name") == SHAPES_STEP_RANGE for e in events)
    assert all("Input Dims" in e["args"] for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::addmm")


def test_long_tensorlists_get_their_shapes(tmp_path):
    """foreach AdamW over 40 parameters: the trace export drops lists longer than 30 ("[0 tensors]"
    in the op table); the runner writes them from the profiler's events."""
    script = tmp_path / "forty.py"
    script.write_text(
        "import torch, torch.nn as nn\n"
        "m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)])  # 40 parameters\n"
        "opt = torch.optim.AdamW(m.parameters(), foreach=True)\n"
        "for _ in range(12):\n"
        "    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n")
    r = run_script(str(script), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)))
    assert r.status == "stopped", r.error
    with open(r.trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    lerp = [e for e in events if e["name"] == "aten::_foreach_lerp_" and "Input Dims" in e["args"]]
    assert lerp, "the shapes step's foreach AdamW"
    dims = lerp[0]["args"]["Input Dims"]
    assert len(dims[0]) == 40 and dims[0][:2] == [[4, 4], [4]] and len(dims[1]) == 40


def test_a_print_after_the_loop_is_not_a_per_step_sync(tmp_path):
    # The loop ends exactly after the recorded steps, so kprof is still waiting for its shapes
    # step when the script's final print(loss.item()) runs: that is code after the loop, run once.
    script = tmp_path / "after_loop.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(6):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 4:
                loss.item()  # in a recorded step: counted
        print("final", loss.item())
        """))
    r = run_script(str(script), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path)))
    assert r.status == "completed" and r.steps_recorded == 2
    lines = {s["line"]: s["count"] for s in r.syncs_cpu}
    assert lines == {10: 1}  # line 11, after the loop, is gone
    assert r.sync_steps == 3  # profiler warm-up + 2 recorded: not the shapes step that never came


def test_without_the_sync_detector_no_torch_function_mode_is_active(tmp_path):
    # kprof apply --compare's compile variants: torch.compile must not trace kprof's mode
    script = tmp_path / "modes.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        depths = []
        for i in range(8):
            depths.append(torch._C._len_torch_function_stack())
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        open(__file__ + ".depths", "w").write(repr(depths))
        """))
    for detect, active in ((True, True), (False, False)):
        r = run_script(str(script), [], RunConfig(warmup=1, steps=2, trace_dir=str(tmp_path), run_to_end=True,
                                                  detect_syncs=detect))
        assert r.status == "completed"
        depths = eval((tmp_path / "modes.py.depths").read_text())
        assert any(depths) is active, depths
