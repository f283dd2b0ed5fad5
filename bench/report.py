"""Benchmark output: a Markdown table on stdout and in table.md, results.json for machines, and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench.versus import plain_table, versus_table


def _fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def speedup_table(rows: list[dict]) -> str:
    """Configurations down, workloads across: decode tok/s and (speedup over its own baseline)."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cell = {(r["config"], r["workload"]): r for r in rows}
    lines = ["| config | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for c in configs:
        cells = []
        for w in workloads:
            r = cell.get((c, w))
            cells.append(f"{_fmt(r['tok_s'], 1)} ({_fmt(r['speedup'])}x)" if r else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DETAIL_COLUMNS = [
    ("config", "config", None),
    ("workload", "workload", None),
    ("tok/s", "tok_s", 1),
    ("TTFT ms", "ttft_ms", 0),
    ("accept", "acceptance", 2),
    ("mean len", "mean_accepted_length", 2),
    ("speedup", "speedup", 2),
    ("same text", "same_text", 2),
    ("draft %", "draft_pct", 1),
    ("verify %", "verify_pct", 1),
    ("mask %", "mask_pct", 1),
    ("overhead %", "overhead_pct", 1),
    ("ideal tok/s", "ideal_tok_s", 1),
    ("efficiency", "efficiency", 2),
    ("draft ms/tok", "draft_ms_per_token", 2),
    ("verify ms/step", "verify_ms_per_step", 2),
    ("mask us/step", "mask_us_per_step", 0),
]


def detail_table(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in DETAIL_COLUMNS) + " |",
        "|" + "---|" * len(DETAIL_COLUMNS),
    ]
    for r in rows:
        lines.append(
            "| " + " | ".join(_fmt(r[k], d) if d is not None else str(r[k]) for _, k, d in DETAIL_COLUMNS) + " |"
        )
    return "\n".join(lines)


def _styles(configs: list[str], family: dict[str, str], plt) -> dict[str, tuple[tuple, str]]:
    """A colour per configuration, tandem's from one colour map and llama-server's from another (and hatched), so
    that two dozen configurations stay apart and each side reads as one group."""
    ours = [c for c in configs if family.get(c) != "llama-server"]
    peers = [c for c in configs if family.get(c) == "llama-server"]
    style: dict[str, tuple[tuple, str]] = {}
    for names, cmap, hatch in ((ours, plt.get_cmap("viridis"), ""), (peers, plt.get_cmap("autumn"), "//")):
        for i, c in enumerate(names):
            style[c] = (cmap(0.9 * i / max(len(names) - 1, 1)), hatch)
    return style


def plots(out: Path, rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    configs = [
        c for c in dict.fromkeys(r["config"] for r in rows) if not c.endswith("target-only") and c != "llama-server"
    ]
    cell = {(r["config"], r["workload"]): r for r in rows}
    style = _styles(configs, {r["config"]: r["family"] for r in rows}, plt)
    legend_rows = -(-len(configs) // 3)  # three columns under the plot, so that no bar hides behind it

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(workloads)), 4.5 + 0.17 * legend_rows))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        values = [(cell.get((c, w)) or {}).get("speedup") or 0 for w in workloads]
        color, hatch = style[c]
        xs = [x + i * width for x in range(len(workloads))]
        ax.bar(xs, values, width, label=c, color=color, hatch=hatch, edgecolor="white", linewidth=0.3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("decode speedup over own baseline")
    ax.set_title("Speedup by workload and configuration (hatched: llama-server)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    path = out / "speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for c in configs:
        pos = [r["acceptance_by_position"] for r in rows if r["config"] == c and r["acceptance_by_position"]]
        if not pos:
            continue
        n = max(len(p) for p in pos)
        mean = []
        for i in range(n):
            vals = [p[i] for p in pos if i < len(p) and p[i] is not None]
            mean.append(sum(vals) / len(vals) if vals else None)
        color, hatch = style[c]
        ax.plot(range(1, n + 1), mean, marker="o", label=c, color=color, linestyle="--" if hatch else "-")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1.05)
    dashed = any(line.get_linestyle() == "--" for line in ax.get_lines())
    ax.set_title("Acceptance by draft position (mean over workloads" + ("; dashed: llama-server)" if dashed else ")"))
    if ax.get_lines():  # a run without drafts (target-only rows only) has nothing to label
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no drafted tokens in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    path = out / "acceptance_by_position.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    tandem = [c for c in dict.fromkeys(r["config"] for r in rows if r["family"] == "tandem")]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(tandem)), 4.5))
    parts = [
        ("draft_pct", "draft compute"),
        ("verify_pct", "verify compute"),
        ("mask_pct", "grammar masks"),
        ("overhead_pct", "overhead"),
    ]
    bottoms = [0.0] * len(tandem)
    for key, label in parts:
        vals = []
        for c in tandem:
            xs = [r[key] for r in rows if r["config"] == c and r.get(key) is not None]
            vals.append(sum(xs) / len(xs) if xs else 0)
        ax.bar(range(len(tandem)), vals, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(range(len(tandem)), tandem, rotation=30, ha="right")
    ax.set_ylabel("% of decode time (mean over workloads)")
    ax.set_title("Round time split")
    ax.legend()
    fig.tight_layout()
    path = out / "round_split.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def _machine_line(machine: dict) -> str:
    if "cpu" not in machine:
        return ""
    return f" · {machine['cpu']}, {machine['cpus']} CPUs, {'/'.join(machine.get('simd', [])) or 'no AVX2'}"


def head_to_head_section(head_to_head: list[dict], noise: dict[str, float], plain: list[dict]) -> str:
    """The versus tables (bench.versus) with the run's noise, or nothing when one family is missing."""
    if not head_to_head and not plain:
        return ""
    spread = ", ".join(f"{name} {value:.2f}" for name, value in noise.items())
    return (
        "## Best against best\n\n"
        "Each side's best speculative configuration per workload (geometric mean of per-prompt, per-repetition "
        "speedups), with a bootstrap interval over the (prompt, repetition) units that re-selects each side's best in "
        "every resample.\n"
        + (f"Repetitions of one prompt differed by (median max/min tok/s): {spread}.\n" if spread else "")
        + f"\n{versus_table(head_to_head)}\n\n"
        + (
            "Target-only decoding against llama-server's plain decoding, per (prompt, repetition) unit, geometric mean "
            f"with a bootstrap interval:\n\n{plain_table(plain)}\n\n"
            if plain
            else ""
        )
    )


def write_report(
    out: Path,
    meta: dict,
    rows: list[dict],
    records: list,
    head_to_head: list[dict] | None = None,
    noise: dict[str, float] | None = None,
    plain: list[dict] | None = None,
) -> None:
    summary = speedup_table(rows)
    detail = detail_table(rows)
    text = (
        f"# tandem benchmark\n\n{meta['date']} · `{meta['command']}` · reps {meta['reps']} · "
        f"max_tokens {meta['max_tokens']} · {meta['seconds']} s{(' · ' + meta['label']) if meta['label'] else ''}"
        f"{_machine_line(meta.get('machine', {}))}\n\n"
        + (
            f"**Interrupted after {meta['interrupted_after_requests']} requests: the last repetition is partial.**\n\n"
            if meta.get("interrupted_after_requests")
            else ""
        )
        + f"## Decode tok/s (speedup over its own baseline)\n\n{summary}\n\n"
        + head_to_head_section(head_to_head or [], noise or {}, plain or [])
        + f"## Details\n\n{detail}\n"
    )
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "head_to_head": head_to_head or [],
                "noise": noise or {},
                "plain_versus": plain or [],
                "records": [asdict(r) for r in records],
            },
            indent=1,
        )
    )
    written = plots(out, rows)
    print(text)
    print(f"results: {out}/results.json, {out}/table.md, " + ", ".join(str(p) for p in written))
