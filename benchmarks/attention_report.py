"""What the attention benchmark's rows add up to: speedups against fa2, the fused-vs-separate rotary
summary (issue 4), and the markdown report next to the JSON."""

import json
from pathlib import Path

from benchmarks.attention_impls import SEPARATE_ROTARY
from benchmarks.attention_workload import PASSES


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_fa2 = fa2 ms / ms for the same shape, pass and rotary (None without both); the
    same for the CUDA-graph times."""
    for prefix in ("", "graph_"):
        ms = prefix + "ms"
        fa2_ms = {(r["shape"], r["pass"], r["rotary"]): r[ms] for r in rows if r["impl"] == "fa2" and r.get(ms)}
        for row in rows:
            baseline = fa2_ms.get((row["shape"], row["pass"], row["rotary"]))
            row[prefix + "speedup_vs_fa2"] = baseline / row[ms] if baseline and row.get(ms) else None


def rotary_fusion(rows: list[dict]) -> list[dict]:
    """Issue 4: each X+separate_rotary row against X fused (rotary=True) and X without rotary."""
    ms = {(r["impl"], r["shape"], r["pass"], r["rotary"]): r["ms"] for r in rows}
    summary = []
    for row in rows:
        if not row["impl"].endswith(SEPARATE_ROTARY) or row["ms"] is None:
            continue
        backend = row["impl"].removesuffix(SEPARATE_ROTARY)
        separate = row["ms"]
        fused = ms.get((backend, row["shape"], row["pass"], True))
        attention = ms.get((backend, row["shape"], row["pass"], False))
        fused_cost = fused - attention if fused and attention else None
        separate_cost = separate - attention if attention else None
        measurable = fused_cost is not None and fused_cost > 0 and separate_cost is not None
        summary.append({
            "backend": backend,
            "shape": row["shape"],
            "pass": row["pass"],
            "attention_ms": attention,  # the backend without rotary
            "fused_ms": fused,  # attention with fused rotary
            "separate_ms": separate,  # attention without rotary + compiled rotary ops
            "separate_over_fused": separate / fused if fused else None,
            # What rotary adds on top of attention, separate vs fused (None if fused adds nothing measurable).
            "rotary_cost_ratio": separate_cost / fused_cost if measurable else None,
        })
    return summary


# ------------------------------------------------------------------------------------------ markdown


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def row_note(row: dict) -> str:
    if row["status"] == "skipped":
        return "skipped: " + _cell(row["skip_reason"] or "")
    notes = []
    if row["status"] == "mismatch":
        notes.append(f"MISMATCH: {row['check']}")
    if row["bwd_timing"] and row["bwd_timing"] != "retain_graph":
        notes.append(_cell(row["bwd_timing"]))
    return "; ".join(notes)


def render_shape_table(rows: list[dict], shape_label: str) -> str:
    """One shape's rows, grouped by pass then rotary so the impls being compared sit together."""
    selected = [r for r in rows if r["shape"] == shape_label]
    selected.sort(key=lambda r: (PASSES.index(r["pass"]), r["rotary"]))  # stable: impl order kept
    tokens = selected[0]["tokens"] if selected else 0
    graphed = any(r.get("graph_ms") is not None for r in selected)
    graph_head, graph_rule = (" graph ms | graph % copy | graph vs fa2 | eager / graph |", "---:|---:|---:|---:|") if graphed else ("", "")
    lines = [
        f"### {shape_label} (T = {tokens} tokens)",
        "",
        f"| impl | pass | rotary | ms | % copy BW | speedup vs fa2 |{graph_head} note |",
        f"|---|---|---|---:|---:|---:|{graph_rule}---|",
    ]
    for r in selected:
        graph_cells = ""
        if graphed:
            frac = r.get("graph_frac_copy_bw")
            # Host cost an eager call adds beyond its device time (the graph replay has none).
            eager_over_graph = r["ms"] / r["graph_ms"] if r["ms"] and r.get("graph_ms") else None
            graph_cells = (f" {_fmt(r.get('graph_ms'), '.3f')} | {_fmt(None if frac is None else 100 * frac, '.1f', '%')} "
                           f"| {_fmt(r.get('graph_speedup_vs_fa2'), '.2f', '×')} | {_fmt(eager_over_graph, '.2f', '×')} |")
        lines.append(
            f"| {r['impl']} | {r['pass']} | {'yes' if r['rotary'] else 'no'} | {_fmt(r['ms'], '.3f')} "
            f"| {_fmt(None if r['frac_copy_bw'] is None else 100 * r['frac_copy_bw'], '.1f', '%')} "
            f"| {_fmt(r['speedup_vs_fa2'], '.2f', '×')} |{graph_cells} {row_note(r)} |"
        )
    return "\n".join(lines)


def render_rotary_fusion(summary: list[dict]) -> str:
    lines = [
        "### Fused vs separate rotary (issue 4)",
        "",
        "attention = the backend without rotary; fused = with `rotary=Rotary(...)`; separate = without rotary "
        "after compiled rotary ops. rotary cost ratio = (separate − attention) / (fused − attention).",
        "",
        "| backend | shape | pass | attention ms | fused ms | separate ms | separate / fused | rotary cost ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['backend']} | {s['shape']} | {s['pass']} | {_fmt(s['attention_ms'], '.3f')} "
            f"| {_fmt(s['fused_ms'], '.3f')} | {_fmt(s['separate_ms'], '.3f')} | {_fmt(s['separate_over_fused'], '.2f', '×')} "
            f"| {_fmt(s['rotary_cost_ratio'], '.2f', '×')} |"
        )
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    versions = ", ".join(f"{name} {value}" for name, value in report["versions"].items())
    lines = [
        "# Block attention benchmark",
        "",
        f"- device: {report['device']}",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- versions: {versions}",
        f"- copy ceiling: {_fmt(report['copy_bw_tbps'], '.3f')} TB/s (device-to-device copy of "
        f"{settings['copy_bytes'] / 2**30:g} GiB, bytes read + written)",
        f"- timing: {settings['timer']}, median, warmup {settings['warmup_ms']} ms, rep {settings['rep_ms']} ms; "
        "bwd replays `torch.autograd.grad(..., retain_graph=True)` on one forward graph",
        f"- data: {settings['dtype']} random normal, seed {settings['seed']}; % copy BW = minimum bytes "
        "(fwd 4, bwd 8, fwd+bwd 12 × T·H·D elements, plus the fp32 cos/sin tables per pass with rotary) "
        "/ time / copy ceiling",
        "",
    ]
    for label in dict.fromkeys(r["shape"] for r in report["rows"]):
        lines += [render_shape_table(report["rows"], label), ""]
    if report["rotary_fusion"]:
        lines += [render_rotary_fusion(report["rotary_fusion"]), ""]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{out}.md").write_text(render_markdown(report))
