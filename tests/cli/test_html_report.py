"""`kprof report --html`: the self-contained HTML report (issue 24).

The run is built as in test_snapshots.py: kprof's real analysis of the checked-in tiny Llama CPU
trace (tests/data/llama_cpu.json.gz), saved with that trace and a plan from kprof's own suggest.
The page is read with the stdlib html.parser: no network reference, the embedded data, the SVG
points. The browser test opens it in headless Chromium and is skipped where none is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kprof import cli, store

from test_snapshots import REPO, RUN, analysed_run  # the same fixture run (pytest puts tests/cli on sys.path)

TRACE = REPO / "tests" / "data" / "llama_cpu.json.gz"


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
    """What the tests look at: every src/href, the scripts, the SVG's points, ids, the text."""

    def __init__(self, text: str):
        super().__init__()
        self.refs: list[str] = []
        self.scripts: list[tuple[dict, str]] = []
        self.points = 0
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
    assert cli.html_default(["apply", "t.py", "--html"]) == ["apply", "t.py", "--html"]  # not report's


def _chromium() -> str | None:
    return next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary on PATH (Debian's `chromium` package); "
                    "the README's set-up does not install one")
def test_in_headless_chromium(root, tmp_path):
    """The page as a browser runs it: the script ends without an error (it marks the body last)
    and the rendered SVG has one point per placed op group. KPROF_SCREENSHOT=PATH also saves a
    1280x800 screenshot there (docs/report.png is made so)."""
    out = tmp_path / "r.html"
    code, page = _html(root, root / RUN, out)
    assert code == 0 and page is not None
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]

    def dump(url: str) -> tuple[str, list[str]]:
        """The rendered DOM and every console line. Chromium logs console.error and uncaught
        exceptions alike as INFO:CONSOLE, and the page logs nothing, so any such line fails."""
        res = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout, [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln]

    # The check can see an error: a page that throws is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>throw new Error('planted')</script></body></html>")
    assert any("planted" in ln for ln in dump(bad.as_uri())[1])
    html, console = dump(out.as_uri())
    assert not console, console
    dom = Page(html)
    assert dom.body_attrs.get("data-kprof-ready") == str(_placed(page)), dom.body_attrs
    assert dom.points == _placed(page) > 0
    shot = os.environ.get("KPROF_SCREENSHOT")
    if shot:
        res = subprocess.run([*flags, "--window-size=1280,800", f"--screenshot={shot}", out.as_uri()],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and Path(shot).stat().st_size > 10_000, res.stderr[-2000:]
