"""Render the Helm chart (deploy/helm/appliance) into the plain manifests under
deploy/manifests/, one file per example values file in deploy/helm/examples/.

    python -m devtools.helm_render          # rewrite deploy/manifests/
    python -m devtools.helm_render --check  # exit 1 when they are out of date

Rendering uses Helm itself (its Go engine, through the ``helm-python-sdk`` wheel's
bundled library), as ``helm template site deploy/helm/appliance -n edge -f EXAMPLE``
would. tests/deploy/test_chart.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "appliance"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
MANIFESTS = ROOT / "deploy" / "manifests"
RELEASE, NAMESPACE = "site", "edge"
HEADER = (
    "# Rendered from deploy/helm/appliance with deploy/helm/examples/{example}\n"
    "# (python -m devtools.helm_render; do not edit: tests/deploy/test_chart.py checks it)\n"
)


def render(values: dict[str, Any], release: str = RELEASE, namespace: str = NAMESPACE) -> str:
    """The chart's manifests for ``values``, as one multi-document YAML stream."""
    import helm_python  # test-only dependency: the Helm SDK's shared library

    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=release, namespace=namespace, is_install=True)
    docs = []
    for name in sorted(files):
        text = files[name].strip()
        if name.endswith(".yaml") and any(d for d in yaml.safe_load_all(text) if d):
            docs.append(f"# Source: {name}\n{text}\n")
    return "---\n".join(docs)


def expected() -> dict[Path, str]:
    out = {}
    for example in sorted(EXAMPLES.glob("*.yaml")):
        values = yaml.safe_load(example.read_text(encoding="utf-8")) or {}
        out[MANIFESTS / example.name] = HEADER.format(example=example.name) + render(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare")
    args = parser.parse_args(argv)
    wanted = expected()
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    extra = [p for p in MANIFESTS.glob("*.yaml") if p not in wanted]
    if args.check:
        for p in stale + extra:
            print(f"out of date: {p.relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale or extra else 0
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    for p in extra:
        p.unlink()
    for p, text in wanted.items():
        p.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
