"""`kprof report --html` and `kprof apply --html`: the self-contained HTML report (issue 24).

The run is built as in test_snapshots.py: kprof's real analysis of the checked-in tiny Llama CPU
trace (tests/data/llama_cpu.json.gz), saved with that trace and a plan from kprof's own suggest.
The before/after view reads a recorded apply: the 1B Llama's plan run and its apply run on an
H200 (benchmarks/results/runs-llama1b-h200-20261202T1555, copied). The page is read
with the stdlib html.parser: no network reference, the embedded data, the SVG points and arrows,
the timeline's rows, the module tree's nodes. The browser tests open it in headless Chromium and
are skipped where none is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

import pyarrow.parquet as pq
import pytest

from kprof import cli, store

from test_snapshots import REPO, RUN, analysed_run  # the same fixture run (pytest puts tests/cli on sys.path)

TRACE = REPO / "tests" / "data" / "llama_cpu.json.gz"
APPLY_FIXTURE = REPO / "benchmarks" / "results" / "runs-llama1b-h200-20261202T1555"
BEFORE, AFTER = "20261202-155556-llama_train", "20261202-155744-llama_train"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from kprof.analyze.profile import load_run
    from kprof.plan.suggest import plan_for

    root = tmp_path_factory.mktemp("html") / "runs"
    summary, ops = analysed_run(root.parent / "cache")
    store.save_run(summary, ops, TRACE, root=root, name=RUN)
    plan_for(load_run(root / RUN))  # writes plan.json, as `kprof suggest` does
    return root


class Page(HTMLParser):
    """What the tests look at: every src/href, the scripts, the SVG's points and arrows, ids, the
    timeline's rows, the module tree's nodes (in document order), the text."""

    def __init__(self, text: str):
        super().__init__()
        self.refs: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self.points = 0
        self.arrows = 0
        self.steps: list[str] = []
        self.nodes: list[dict] = []
        self.links: dict[str, str] = {}
        self.tree_attrs: dict = {}
        self.ids: set[str] = set()
        self.body_attrs: dict = {}
        self.text: list[str] = []
        self._script: dict | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "link" and "stylesheet" in (a.get("rel") or ""):
            self.refs.append(a.get("href") or "<link without href>")
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "body":
            self.body_attrs = a
        if tag == "circle" and "pt" in (a.get("class") or "").split():
            self.points += 1
        if tag == "line" and "arrow" in (a.get("class") or "").split():
            self.arrows += 1
        if tag == "tr" and "data-step" in a:
            self.steps.append(a["data-step"])
        if "data-path" in a:
            self.nodes.append(a)
        if tag == "a" and a.get("id"):
            self.links[a["id"]] = a.get("href") or ""
        if a.get("id") == "modtree":
            self.tree_attrs = a
        if tag == "script":
            self._script = a
            self.scripts.append((a, ""))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "script":
            self._script = None

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            a, body = self.scripts[-1]
            self.scripts[-1] = (a, body + data)
        else:
            self.text.append(data)

    def data(self) -> dict:
        blobs = [body for a, body in self.scripts if a.get("id") == "kprof-data"]
        assert len(blobs) == 1, f"{len(blobs)} embedded data blocks"
        return json.loads(blobs[0])

    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


def _html(root: Path, run_dir: Path, out: Path, *extra: str) -> tuple[int, Page | None]:
    """`kprof report RUN --html OUT` through main(), as from a shell: (exit code, the page)."""
    try:
        cli.main(["report", str(run_dir), "--html", str(out), "--out", str(root), *extra])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, Page(out.read_text()) if out.is_file() else None


def _op_groups(run_dir: Path) -> int:
    """The run's (module, op) groups, counted from ops.parquet with pyarrow, not through kprof."""
    t = pq.read_table(run_dir / "ops.parquet", columns=["module", "op"]).to_pylist()
    return len({(r["module"], r["op"]) for r in t})


def test_self_contained_with_every_op_group(root, tmp_path):
    code, page = _html(root, root / RUN, tmp_path / "r.html")
    assert code == 0 and page is not None
    remote = [r for r in page.refs if r.startswith(("http:", "https:", "//"))]
    assert not remote, remote
    assert not [a for a, _ in page.scripts if a.get("src")], "a script loaded from elsewhere"
    data = page.data()
    groups = _op_groups(root / RUN)
    assert groups > 10  # the fixture is a real model step, not a toy table
    assert len(data["points"]) == groups
    placed = [p for p in data["points"] if p["placed"]]
    # Every group that can sit on a log-log roofline is drawn; the rest say why not.
    assert page.points == len(placed) > 0
    assert all(p["why_not"] for p in data["points"] if not p["placed"])
    assert all(p["intensity"] > 0 and p["tflops"] > 0 for p in placed)
    # The ceilings drawn are the run's.
    summary = json.loads((root / RUN / "summary.json").read_text())
    assert data["ceilings"]["mem_bw_gbs"] == summary["ceilings"]["mem_bw_gbs"]
    assert "cpu-banner" in page.ids and "CPU run" in page.all_text()
    # The plan's suggestions, and nothing named missing in a complete run.
    plan = json.loads((root / RUN / "plan.json").read_text())
    ids = [s["id"] for s in [*plan["suggestions"], *plan.get("diagnoses", [])]]
    assert ids and all(i in page.all_text() for i in ids)
    assert data["missing"] == [] and "missing" not in page.ids
    text = page.all_text()
    for word in ("Top ops by time", "model.layers.0", "Host syncs", "losses[-1].item()", "memory-bound"):
        assert word in text, word


def test_default_file_and_force_keeps_a_backup(root, tmp_path):
    run = tmp_path / RUN
    shutil.copytree(root / RUN, run)
    with pytest.raises(SystemExit) as e:  # typer exits 0 through SystemExit in standalone mode
        cli.main(["report", str(run), "--html", "--out", str(tmp_path)])
    assert (e.value.code or 0) == 0
    out = run / "report.html"
    assert "kprof-data" in out.read_text()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # a page to share, not a private temp file
    out.write_text("the user's own edits")
    code, _ = _html(tmp_path, run, out)
    assert code == 2 and out.read_text() == "the user's own edits"
    code, page = _html(tmp_path, run, out, "--force")
    assert code == 0 and page is not None and page.points > 0
    assert (run / "report.html.bak").read_text() == "the user's own edits"


def test_refuses_existing_file_in_one_line(root, tmp_path, capsys):
    out = tmp_path / "mine.html"
    out.write_text("keep me")
    code, _ = _html(root, root / RUN, out)
    err = capsys.readouterr().err
    assert code == 2 and out.read_text() == "keep me"
    flat = "".join(err.split())  # rich folds a long temporary path at 80 columns, mid-word too
    assert "--html" in flat and "--force" in flat and "mine.html.bak" in flat


def test_missing_trace_and_corrupt_ops_still_report(root, tmp_path):
    run = tmp_path / RUN
    shutil.copytree(root / RUN, run)
    (run / "trace.json.gz").unlink()
    (run / "ops.parquet").write_bytes(b"not parquet")
    code, page = _html(tmp_path, run, tmp_path / "r.html")
    assert code == 0 and page is not None
    data = page.data()
    missing = " ".join(data["missing"])
    assert "trace.json.gz" in missing and "ops.parquet" in missing and "corrupt" in missing
    assert "missing" in page.ids and "ops.parquet" in page.all_text()
    # What the summary holds is still there; the roofline, which needs the op table, is not.
    assert data["points"] == [] and page.points == 0
    assert "model.layers.0" in page.all_text() and "cpu-banner" in page.ids
    # The timeline has the summary's steps (busy and idle, no classes); the module tree and the
    # trace link say what they lack.
    assert page.steps == ["0", "1"] and all(not r["classes"] for r in data["timeline"]["rows"])
    assert page.nodes == [] and "no module tree: it needs the op table" in page.all_text()
    assert "trace-link" not in page.links and "none in this run" in page.all_text()


def test_corrupt_trace_and_no_plan_are_named(root, tmp_path):
    run = tmp_path / RUN
    shutil.copytree(root / RUN, run)
    (run / "trace.json.gz").write_bytes(b"\x00garbage, not gzip")
    (run / "plan.json").unlink()
    code, page = _html(tmp_path, run, tmp_path / "r.html")
    assert code == 0 and page is not None
    missing = " ".join(page.data()["missing"])
    assert "trace.json.gz is corrupt" in missing and "kprof suggest" in missing
    assert page.points == _placed(page)  # the op table is intact: the roofline is drawn


def test_points_add_up_to_the_op_table(root, tmp_path):
    """Each point's time and intensity recomputed here from ops.parquet (pyarrow, not kprof)."""
    code, page = _html(root, root / RUN, tmp_path / "r.html")
    assert code == 0 and page is not None
    rows = pq.read_table(root / RUN / "ops.parquet", columns=["module", "op", "device_time (us)", "flops", "bytes"])
    n_steps = json.loads((root / RUN / "summary.json").read_text())["steps_recorded"]
    sums: dict[tuple, list[float]] = {}
    for r in rows.to_pylist():
        s = sums.setdefault((r["module"], r["op"]), [0.0, 0.0, 0.0])
        s[0] += r["device_time (us)"] or 0.0
        s[1] += r["flops"] or 0.0
        s[2] += r["bytes"] or 0.0
    for p in page.data()["points"]:
        t, f, b = sums[(p["module"], p["op"])]
        assert p["ms_per_step"] == pytest.approx(t / n_steps / 1e3), p
        if p["placed"]:
            assert p["intensity"] == pytest.approx(f / b) and p["tflops"] == pytest.approx(f / (t * 1e-6) / 1e12), p


def _placed(page: Page) -> int:
    return sum(p["placed"] for p in page.data()["points"])


def test_html_default_fills_only_a_missing_file():
    d = cli.DEFAULT_HTML
    assert cli.html_default(["report", "--html"]) == ["report", "--html", d]
    assert cli.html_default(["report", "--html", "--force"]) == ["report", "--html", d, "--force"]
    assert cli.html_default(["report", "r1", "--html", "x.html"]) == ["report", "r1", "--html", "x.html"]
    assert cli.html_default(["apply", "t.py", "--html"]) == ["apply", "t.py", "--html", d]
    assert cli.html_default(["apply", "t.py", "--html", "--", "--lr", "1"]) == [
        "apply", "t.py", "--html", d, "--", "--lr", "1"]
    # what follows `--` is the script's own, and other commands have no --html
    assert cli.html_default(["apply", "t.py", "--", "--html"]) == ["apply", "t.py", "--", "--html"]
    assert cli.html_default(["suggest", "--html"]) == ["suggest", "--html"]


def _chromium() -> str | None:
    return next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)


NO_CHROMIUM = pytest.mark.skipif(_chromium() is None, reason="no chromium binary on PATH (Debian's `chromium` "
                                 "package); the README's set-up installs it where apt-get works")


def _flags(tmp_path: Path) -> list[str]:
    return [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]


def _dump(tmp_path: Path, url: str) -> tuple[str, list[str]]:
    """The rendered DOM and every console line. Chromium logs console.error and uncaught
    exceptions alike as INFO:CONSOLE, and the page logs nothing, so any such line fails."""
    res = subprocess.run([*_flags(tmp_path), "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout, [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln]


def _sorted_by(nodes: list[dict], key: str) -> bool:
    """Every level of the tree (siblings: one parent) in decreasing `key`, in document order."""
    last: dict[str, float] = {}
    for n in nodes:
        v, path = float(n[key]), n["data-path"]
        par = "<top>" if path == "" or path.startswith("<") else n["data-parent"]
        if par in last and v > last[par] + 1e-9:
            return False
        last[par] = v
    return True


@NO_CHROMIUM
def test_in_headless_chromium(root, tmp_path):
    """The page as a browser runs it: the script ends without an error (it marks the body last)
    and the rendered SVG has one point per placed op group; #sort=bwd runs the module tree's sort
    on load, which orders every level by backward time. KPROF_SCREENSHOT=PATH also saves a
    1280x800 screenshot there (docs/report.png is made so)."""
    out = tmp_path / "r.html"
    code, page = _html(root, root / RUN, out)
    assert code == 0 and page is not None
    # The check can see an error: a page that throws is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>throw new Error('planted')</script></body></html>")
    assert any("planted" in ln for ln in _dump(tmp_path, bad.as_uri())[1])
    html, console = _dump(tmp_path, out.as_uri())
    assert not console, console
    dom = Page(html)
    assert dom.body_attrs.get("data-kprof-ready") == str(_placed(page)), dom.body_attrs
    assert dom.points == _placed(page) > 0
    assert _sorted_by(dom.nodes, "data-tot") and not _sorted_by(dom.nodes, "data-bwd")
    html, console = _dump(tmp_path, out.as_uri() + "#sort=bwd")
    assert not console, console
    dom = Page(html)
    assert dom.tree_attrs.get("data-sorted") == "bwd-desc" and dom.body_attrs.get("data-kprof-ready")
    assert _sorted_by(dom.nodes, "data-bwd") and len(dom.nodes) == len(page.nodes)
    shot = os.environ.get("KPROF_SCREENSHOT")
    if shot:
        res = subprocess.run([*_flags(tmp_path), "--window-size=1280,800", f"--screenshot={shot}", out.as_uri()],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and Path(shot).stat().st_size > 10_000, res.stderr[-2000:]


@NO_CHROMIUM
def test_apply_page_in_headless_chromium(apply_root, apply_page, tmp_path):
    """The before/after page in a browser: no console error, the before run's points and one
    arrow per patch with both points in the rendered SVG."""
    out, page = apply_page
    html, console = _dump(tmp_path, out.as_uri())
    assert not console, console
    dom = Page(html)
    assert dom.body_attrs.get("data-kprof-ready") == str(_placed(page))
    assert dom.arrows == page.arrows == len(_expected_arrows(apply_root))


# ---------------------------------------------------------------------------------------------
# The step timeline, the module tree, the trace link


def test_step_timeline_rows_match_the_steps(root, tmp_path):
    """One row per recorded step, with its op time per class summed here from ops.parquet and
    the host sync marked in the step the detector saw it in (its step j + 1 is recorded step j)."""
    code, page = _html(root, root / RUN, tmp_path / "r.html")
    assert code == 0 and page is not None
    t = pq.read_table(root / RUN / "ops.parquet", columns=["step", "class", "device_time (us)"]).to_pylist()
    steps = sorted({r["step"] for r in t})
    assert page.steps == [str(s) for s in steps] and len(steps) == 2
    rows = page.data()["timeline"]["rows"]
    summary = json.loads((root / RUN / "summary.json").read_text())
    for row, idle in zip(rows, summary["idle_by_step"]):
        want: dict[str, float] = {}
        for r in t:
            if r["step"] == row["step"]:
                want[r["class"]] = want.get(r["class"], 0.0) + r["device_time (us)"] / 1e3
        assert row["classes"] == pytest.approx({k: v for k, v in want.items() if v}), row["step"]
        assert row["busy_ms"] == pytest.approx(idle["busy (us)"] / 1e3)
        assert row["idle_ms"] == pytest.approx(idle["idle (us)"] / 1e3)
    sync_steps = {s - 1 for s in summary["syncs"][0]["steps"]} & set(steps)
    assert {r["step"] for r in rows if r["syncs"]} == sync_steps == {0}
    assert "train_llama.py:42" in page.all_text()


def test_module_tree_has_every_module(root, tmp_path):
    """Every module path of ops.parquet is a node, under its parent; the root's subtree time is
    all the model's op time and the pseudo-modules stand beside it (sums made here, pyarrow)."""
    code, page = _html(root, root / RUN, tmp_path / "r.html")
    assert code == 0 and page is not None
    t = pq.read_table(root / RUN / "ops.parquet", columns=["module", "phase", "device_time (us)"]).to_pylist()
    paths = [n["data-path"] for n in page.nodes]
    assert len(paths) == len(set(paths)) and {r["module"] for r in t} <= set(paths)
    assert "model.layers" in paths  # a container without ops of its own, between its parent and children
    by_path = {n["data-path"]: n for n in page.nodes}
    for n in page.nodes:  # a parent comes before its children
        if n["data-parent"] or n["data-path"] not in ("", "<optimizer>", "<unattributed>"):
            assert paths.index(n["data-parent"]) < paths.index(n["data-path"]), n
    n_steps = json.loads((root / RUN / "summary.json").read_text())["steps_recorded"]
    model = [r for r in t if not r["module"].startswith("<")]
    assert float(by_path[""]["data-tot"]) == pytest.approx(sum(r["device_time (us)"] for r in model) / n_steps / 1e3,
                                                           rel=1e-5)
    for phase in ("fwd", "bwd"):
        want = sum(r["device_time (us)"] for r in model if r["phase"] == phase) / n_steps / 1e3
        assert float(by_path[""][f"data-{phase}"]) == pytest.approx(want, rel=1e-5)
    assert by_path["<optimizer>"]["data-parent"] == "" and float(by_path["<optimizer>"]["data-tot"]) > 0
    assert page.tree_attrs.get("data-sorted") == "tot-desc"


def test_trace_link_is_relative_to_the_page(root, tmp_path):
    out = tmp_path / "sub" / "r.html"
    out.parent.mkdir()
    code, page = _html(root, root / RUN, out)
    assert code == 0 and page is not None
    href = page.links["trace-link"]
    assert not href.startswith(("/", "file:", "http"))
    assert (out.parent / unquote(href)).resolve() == (root / RUN / "trace.json.gz").resolve()
    text = page.all_text()
    assert "ui.perfetto.dev" in text and "torch" in text  # the versions beside it
    summary = json.loads((root / RUN / "summary.json").read_text())
    assert summary["created"] in text and "kprof profile train_llama.py -- --preset tiny" in text


# ---------------------------------------------------------------------------------------------
# The before/after view of an apply (the recorded H200 runs)


@pytest.fixture(scope="module")
def apply_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("apply") / "runs"
    shutil.copytree(APPLY_FIXTURE, root, ignore=shutil.ignore_patterns("kernels.parquet", "memory.json.gz"))
    return root


@pytest.fixture(scope="module")
def apply_page(apply_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("apply-page") / "apply.html"
    code, page = _html(apply_root, apply_root / AFTER, out)
    assert code == 0 and page is not None
    return out, page


def _expected_arrows(root: Path) -> dict[str, dict]:
    """The patches with both points, from the fixture's own files: a before point where the plan
    measured the patch's ops with a known cost (its class is not 'unknown'), an after point where
    the after run's ops.parquet has rows of the rule's kprof kernels (by the op the code called),
    all with a known cost and FLOPs and bytes; with their time per step, summed here."""
    from kprof.rules import RULES
    from kprof.rules.engine import kernel_spec

    doc = json.loads((root / AFTER / "apply.json").read_text())
    plan = {s["id"]: s for s in json.loads((root / BEFORE / "plan.json").read_text())["suggestions"]}
    after = pq.read_table(root / AFTER / "ops.parquet", columns=["op", "called_op", "device_time (us)", "flops",
                                                                  "bytes", "cost_known"]).to_pylist()
    n_steps = json.loads((root / AFTER / "summary.json").read_text())["steps_recorded"]
    rules = {r.id: r for r in RULES}
    out = {}
    for p in doc["patches"]:
        names = {n for k in rules[p["id"]].kernels if (s := kernel_spec(k)) for n in s.op_costs}
        rows = [r for r in after if (r["called_op"] or r["op"]) in names]
        before_ok = plan[p["id"]]["ms/step"] > 0 and plan[p["id"]]["class"] != "unknown"
        after_ok = bool(rows) and all(r["cost_known"] for r in rows) and sum(r["flops"] for r in rows) > 0 \
            and sum(r["bytes"] for r in rows) > 0
        if before_ok and after_ok:
            out[p["id"]] = {"before_ms": plan[p["id"]]["ms/step"],
                            "after_ms": sum(r["device_time (us)"] for r in rows) / n_steps / 1e3}
    return out


def test_apply_run_has_one_arrow_per_patch_with_both_points(apply_root, apply_page):
    out, page = apply_page
    want = _expected_arrows(apply_root)
    assert len(want) == 3  # linear_cross_entropy's after ops include aten::addmm_, which has no cost formula
    assert page.arrows == len(want)
    ba = page.data()["before_after"]
    drawn = {g["id"]: g for g in ba["patches"] if g["arrow"]}
    assert set(drawn) == set(want)
    for pid, w in want.items():
        assert drawn[pid]["before"]["ms_per_step"] == pytest.approx(w["before_ms"])
        assert drawn[pid]["after"]["ms_per_step"] == pytest.approx(w["after_ms"])
    # every patch of apply.json is listed with its predicted and measured saving; one without an
    # arrow says why
    doc = json.loads((apply_root / AFTER / "apply.json").read_text())
    text = page.all_text()
    for p in doc["patches"]:
        assert p["id"] in text
        assert f"{p['predicted_saving_ms']:.3g}" in text and f"{p['measured_saving_ms']:.3g}" in text
    lce = next(g for g in ba["patches"] if g["id"] == "linear_cross_entropy")
    assert not lce["arrow"] and "aten::addmm_" in lce["why"]
    # the roofline is the before run's, on its ceilings; the header names both runs
    assert page.points == _op_groups_placed(page) and len(page.data()["points"]) == _op_groups(apply_root / BEFORE)
    assert page.data()["roofline_of"] == BEFORE and BEFORE in text and AFTER in text
    # its module tree has the before run's time beside the after run's
    by_path = {n["data-path"]: n for n in page.nodes}
    assert float(by_path["lm_head"]["data-tot"]) == 0 < float(by_path["lm_head"]["data-before"])
    assert page.steps == ["0", "1", "2", "3", "4"]
    assert {r["step"] for r in page.data()["timeline"]["rows"] if r["syncs"]} == {0, 4}
    assert "llama_train.py:82" in text


def _op_groups_placed(page: Page) -> int:
    return sum(p["placed"] for p in page.data()["points"])


def test_apply_run_without_its_before_run(apply_root, tmp_path):
    """The apply run alone (its before run not beside it nor in --out): its own roofline, every
    patch listed without arrows, the before run named missing."""
    shutil.copytree(apply_root / AFTER, tmp_path / "runs" / AFTER)
    code, page = _html(tmp_path / "runs", tmp_path / "runs" / AFTER, tmp_path / "r.html")
    assert code == 0 and page is not None
    missing = " ".join(page.data()["missing"])
    assert f"before run {BEFORE}: not found" in missing and "trace.json.gz" in missing
    assert page.arrows == 0 and len(page.data()["before_after"]["patches"]) == 4
    assert page.points == _op_groups_placed(page) > 0  # the after run's own points


def test_corrupt_apply_json_is_named(apply_root, tmp_path):
    shutil.copytree(apply_root, tmp_path / "runs")
    (tmp_path / "runs" / AFTER / "apply.json").write_text("{not json")
    code, page = _html(tmp_path / "runs", tmp_path / "runs" / AFTER, tmp_path / "r.html")
    assert code == 0 and page is not None
    assert any("apply.json" in m and "corrupt" in m for m in page.data()["missing"])
    assert "before_after" not in page.data() and page.arrows == 0 and page.points > 0


def test_unfinished_apply_draws_from_its_mark(apply_root, tmp_path):
    """An apply that did not finish leaves no apply.json, only the apply_of mark in its run's
    summary: the arrows still come from the two op tables, and the page says what is lacking."""
    shutil.copytree(apply_root, tmp_path / "runs")
    (tmp_path / "runs" / AFTER / "apply.json").unlink()
    code, page = _html(tmp_path / "runs", tmp_path / "runs" / AFTER, tmp_path / "r.html")
    assert code == 0 and page is not None
    assert any("did not finish" in m for m in page.data()["missing"])
    assert page.arrows == len(_expected_arrows(apply_root)) and len(page.data()["before_after"]["patches"]) == 4


def test_apply_html_option(apply_root, tmp_path, monkeypatch, capsys):
    """`kprof apply SCRIPT --html FILE` writes the before/after page of the run apply saved (the
    runs themselves are patched out: the recorded ones stand in); an existing FILE is refused
    before anything runs, and --compare refuses --html."""
    from kprof.cli import patch_cmds

    runs = tmp_path / "runs"
    shutil.copytree(apply_root, runs)
    calls = []

    def fake_apply(*a, **kw):
        calls.append(a)
        return SimpleNamespace(after=store.load_run(runs / AFTER), watch=None, kept=["rms_norm"], write_lines="")

    monkeypatch.setattr("kprof.patching.apply.apply", fake_apply)
    monkeypatch.setattr(patch_cmds, "render_apply", lambda res: None)

    def run(*args: str) -> int:
        try:
            cli.main(["apply", "train.py", "--out", str(runs), *args])
        except SystemExit as e:
            return e.code or 0
        return 0

    out = tmp_path / "ba.html"
    assert run("--html", str(out)) == 0 and len(calls) == 1
    page = Page(out.read_text())
    assert page.arrows == len(_expected_arrows(apply_root)) and "before-after" in page.ids
    assert run("--html") == 0 and (runs / AFTER / "report.html").is_file()  # the default: in the after run
    capsys.readouterr()
    assert run("--html", str(out)) == 2 and len(calls) == 2  # exists: refused before apply ran
    assert "--force" in "".join(capsys.readouterr().err.split())
    assert run("--html", str(out), "--force") == 0 and (tmp_path / "ba.html.bak").is_file()
    assert run("--compare", "--html", str(tmp_path / "c.html")) == 2 and len(calls) == 3
