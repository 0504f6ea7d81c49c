"""What the README and docs/ name exists: the metrics, the modules `python -m` runs and the files of
this repository they point at, so a manual cannot keep describing something that was removed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: docs/investigations.md is left out: it records removed scripts by design, each with the commit
#: that still holds it.
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "investigations.md"),
]
METRIC = re.compile(r"\bprefixgate_[a-z_]+[a-z]\b")
MODULE = re.compile(r"python -m ([\w.]+)")
REPO_PATH = re.compile(r"`((?:proxy|routing|tokenization|bench|tests|deploy|docs|\.ci)/[\w./-]*)`")
#: Suffixes the Prometheus client adds to a metric's exposed name.
EXPOSED_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def source_text() -> str:
    files = [*(ROOT / "proxy").rglob("*.py"), *(ROOT / "routing").rglob("*.py")]
    return "\n".join(path.read_text() for path in files)


def test_every_metric_named_is_one_prefixgate_exports():
    source = source_text()
    for page in PAGES:
        for name in set(METRIC.findall(page.read_text())):
            base = next((name.removesuffix(s) for s in EXPOSED_SUFFIXES if name.endswith(s)), name)
            assert f'"{base}"' in source or f'"{name}"' in source, (page.name, name)


def test_every_module_run_with_python_m_exists():
    for page in PAGES:
        for module in set(MODULE.findall(page.read_text())):
            assert importlib.util.find_spec(module) is not None, (page.name, module)


def test_every_repository_path_named_exists():
    for page in PAGES:
        for path in set(REPO_PATH.findall(page.read_text())):
            if path.startswith("bench/out/"):  # what a run writes, not a file of the repository
                continue
            assert (ROOT / path).exists(), (page.name, path)
