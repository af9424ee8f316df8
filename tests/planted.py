"""The planted diagnosis scripts (tests/diagnoses_scripts/) and their tagged lines, shared by the
diagnosis tests."""

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "diagnoses_scripts"


def planted_line(script: str, tag: str) -> int:
    """The 1-based line of the planted `# kprof-test: TAG` comment in `script`."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, t in enumerate(lines, 1) if f"# kprof-test: {tag}" in t)
