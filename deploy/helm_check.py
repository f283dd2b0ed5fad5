#!/usr/bin/env python3
"""Lint the Helm chart strictly and render it offline, with no helm binary (helm-python-sdk: Helm v4's SDK).

For the chart's default values and every example values file (helm/tandem/examples/*.yaml): `helm lint --strict`
(warnings fail, values.schema.json is enforced) and `helm template` into OUT/<values>.yaml, ready for
`kubernetes-validate --strict` and checkov. Exit 1 on any lint finding of warning severity or above, or a render error.

    python deploy/helm_check.py --out build/deploy/rendered
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tandem"
RELEASE = "tandem"
NAMESPACE = "tandem"
KUBE_VERSION = "v1.31.0"
WARNING = 2  # helm-python-sdk severities: 1 info, 2 warning, 3 error


def values_files(chart: Path = CHART) -> dict[str, Path | None]:
    """{name: values file}: "default" (the chart's values.yaml alone), then each example by file stem."""
    files: dict[str, Path | None] = {"default": None}
    for path in sorted((chart / "examples").glob("*.yaml")):
        files[path.stem] = path
    return files


def load_values(path: Path | None) -> dict | None:
    return yaml.safe_load(path.read_text()) if path else None


def lint(values: dict | None, chart: Path = CHART) -> list[str]:
    """Findings of `helm lint --strict` at warning severity or above (empty: clean)."""
    import helm_python as helm

    report = helm.lint(str(chart), values, strict=True, namespace=NAMESPACE, kube_version=KUBE_VERSION)
    problems = [f"{m['path']}: {m['error'].strip()}" for m in report["messages"] if m["severity"] >= WARNING]
    problems += [e.strip() for e in report["errors"] if not any(e.strip() in p for p in problems)]
    return problems


def render(values: dict | None, chart: Path = CHART) -> dict[str, str]:
    """`helm template`: {template path: manifest}, NOTES.txt included."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as loaded:
        return loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(rendered: dict[str, str]) -> str:
    """The Kubernetes objects of a render as one multi-document YAML stream (templates that rendered empty dropped)."""
    docs = [text.strip("\n") for name, text in sorted(rendered.items()) if name.endswith((".yaml", ".yml"))]
    return "\n---\n".join(doc for doc in docs if doc.strip()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the rendered manifests")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for name, path in values_files().items():
        values = load_values(path)
        label = path.relative_to(ROOT) if path else "default values"
        problems = lint(values)
        for problem in problems:
            print(f"helm lint --strict ({label}): {problem}", file=sys.stderr)
        failed |= bool(problems)
        try:
            rendered = render(values)
        except Exception as exc:  # the SDK's render errors carry the template and line
            print(f"helm template ({label}): {exc}", file=sys.stderr)
            failed = True
            continue
        out = args.out / f"{name}.yaml"
        out.write_text(manifests(rendered))
        count = sum(1 for doc in yaml.safe_load_all(out.read_text()) if doc)
        print(f"{label}: {'lint clean, ' if not problems else ''}{count} objects -> {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
