#!/usr/bin/python3
"""Renders bench/results/latest.json:
- docs/benchmarks.md between `<!-- bench:begin -->` and `<!-- bench:end -->`: the
  guardrails (issue #24: each with its measured value, limit, held or broken) and every
  case's table;
- README.md between `<!-- headline:begin -->` and `<!-- headline:end -->`: five headline
  figures against torchrun (skipped, with a note, when the README has no such markers);
- PNG plots with gnuplot into --docs.

Usage: render.py [--json FILE] [--out FILE] [--readme FILE] [--docs DIR]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEAD_BEGIN, HEAD_END = "<!-- headline:begin -->", "<!-- headline:end -->"

# The guardrails of issue #24: what the restructuring may not quietly cost. Each names the
# case and row of bench.py that measures it, the figure (a row's median, or its ratio to the
# peer) and its limit. Kept here, not in bench.py, so that results from before the guardrails
# render them too.
GUARDRAILS = [
    ("launch → exit of 4 × `/bin/true` (median)", "launch_exit", lambda p: p.get("N") == 4,
     "median", "<=", 8.0, "ms"),
    ("a worker fails → all 4 workers of the next attempt started (median)", "restart", lambda p: True,
     "median", "<=", 10.0, "ms"),
    ("agent peak RSS with 4 workers (VmHWM, median)", "agent_rss", lambda p: str(p.get("what", "")).startswith("VmHWM"),
     "median", "<=", 8.0, "MiB"),
    ("log relay, 4 workers: mglaunch / torchrun `--tee 3` (lines/s)", "relay",
     lambda p: "torchrun" in str(p.get("what", "")), "ratio", ">=", 10.0, "x"),
    ("10,000 simulated agents join one daemon (median of two runs)", "daemon_scale",
     lambda p: p.get("agents") == 10000 and str(p.get("what", "")).startswith("time"), "median", "<=", 1000.0, "ms"),
]


def guardrail(res, case_name, match, on):
    """(value, why-not): the measured figure of one guardrail, or None and the reason."""
    case = res["cases"].get(case_name)
    if case is None:
        return None, f"case {case_name} not run"
    if "rows" not in case:
        return None, f"case {case_name}: {case.get('skipped') or case.get('error') or 'no rows'}"
    for r in case["rows"]:
        if match(r["param"]):
            if on == "ratio":
                if r.get("check") and not r["check"]["passed"]:
                    return None, "the relay check failed (lines lost or mixed)"
                return (r["ratio"], None) if r.get("ratio") else (None, "no peer measured")
            return (r["ours"]["median"], None) if r.get("ours") else (None, "no samples")
    return None, f"case {case_name} has no such row (a quick run measures smaller sizes)"


def guardrails_table(res):
    out = ["| guardrail | measured | limit | |", "|---|---|---|---|"]
    held = broken = 0
    for label, case, match, on, op, limit, unit in GUARDRAILS:
        v, why = guardrail(res, case, match, on)
        shown_limit = f"{op.replace('<=', '≤').replace('>=', '≥')} {limit:,g} {unit}" if unit != "x" else \
            f"{op.replace('>=', '≥')} {limit:g}x"
        if v is None:
            out.append(f"| {label} | – | {shown_limit} | not measured: {why} |")
            continue
        ok = v <= limit if op == "<=" else v >= limit
        held, broken = held + ok, broken + (not ok)
        shown = f"{v:.1f}x" if unit == "x" else f"{fmt(v, unit)} {unit}"
        out.append(f"| {label} | {shown} | {shown_limit} | {'held' if ok else '**broken**'} |")
    out.append(f"\n{held} held, {broken} broken, {len(GUARDRAILS) - held - broken} not measured "
               "(bench/render.py `GUARDRAILS`: which case and row of bench.py measures each).")
    return "\n".join(out)


def headline(res):
    """Five lines for the README: ours against torchrun, from the same results."""
    def find(case_name, match):
        case = res["cases"].get(case_name) or {}
        return next((r for r in case.get("rows", []) if match(r["param"])), None)

    def vs(r, unit):
        if not r or not r.get("ours"):
            return "not measured", "–", "–"
        peer = f"{fmt(r['peer']['median'], unit)} {unit}" if r.get("peer") else "–"
        return f"{fmt(r['ours']['median'], unit)} {unit}", peer, ratio(r)
    m = res["meta"]
    rows = [("launch → exit, 4 × `/bin/true`", vs(find("launch_exit", lambda p: p.get("N") == 4), "ms")),
            ("a worker fails → 4 workers restarted", vs(find("restart", lambda p: True), "ms")),
            ("agent peak RSS, 4 workers", vs(find("agent_rss", lambda p: str(p.get("what", "")).startswith("VmHWM")),
                                              "MiB")),
            ("log relay, 4 workers into a pipe", vs(find("relay", lambda p: "torchrun" in str(p.get("what", ""))),
                                                     "lines/s")),
            ("8 loopback agents (c10d) → all workers started", vs(find("rdzv_agents", lambda p: p.get("K") == 8),
                                                                  "ms")),
            ("agent's store: 10,000 clients' init_process_group traffic (vs torch's TCPStore server)",
             vs(find("store", lambda p: p.get("clients") == 10000 and "traffic" in str(p.get("what", ""))), "ms"))]
    # The recoveries: mgtrain's (recovery) and a plain PyTorch script's with mglaunch_recovery (py_recovery, #37).
    for case_name, trainer in (("recovery", "`mgtrain --in-place-recovery`"),
                               ("py_recovery", "a PyTorch DDP script with `mglaunch_recovery`, its standby pre-started")):
        rec = res["cases"].get(case_name) or {}
        t, lost = (find(case_name, lambda p, w=w: str(p.get("what", "")).startswith(w)) for w in ("SIGKILL", "steps lost"))
        if t and t.get("ours") and lost and lost.get("ours"):
            both = lambda s, l: f"{fmt(s['median'], 'ms')} ms, {fmt(l['median'], 'steps')} steps lost" if s and l else "–"
            when = f"; run of {rec['run']['date']}" if rec.get("run") else ""
            rows.append((f"one node SIGKILLed mid-training → first step after it, steps lost (torchrun restarts all "
                         f"from a checkpoint; mglaunch: {'a standby and ' if rec.get('standby') else ''}"
                         f"{trainer}{when})",
                         (both(t["ours"], lost["ours"]), both(t.get("peer"), lost.get("peer")), ratio(t))))
    out = [f"Medians of one `make bench` run ({m['date']}, {m['cores']} cores; generated by bench/render.py "
           "from `bench/results/latest.json`; all cases, guardrails and method in "
           "[docs/benchmarks.md](docs/benchmarks.md)):", "",
           "| | mglaunch | torchrun | advantage |", "|---|---|---|---|"]
    out += [f"| {name} | {a} | {b} | {c} |" for name, (a, b, c) in rows]
    states = []
    for _, case, match, on, op, limit, _ in GUARDRAILS:
        v, _ = guardrail(res, case, match, on)
        states.append(None if v is None else (v <= limit if op == "<=" else v >= limit))
    out += ["", f"Guardrails (issue #24): {states.count(True)} of {len(states)} held"
                + (f", {states.count(False)} broken" if False in states else "")
                + (f", {states.count(None)} not measured" if None in states else "") + "."]
    return "\n".join(out) + "\n"


def splice(path, begin, end, text):
    """Replaces what lies between the markers in `path`; False when the markers are missing."""
    with open(path) as f:
        page = f.read()
    if begin not in page or end not in page:
        return False
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + text + end + tail)
    return True


def fmt(v, unit):
    if v is None:
        return "–"
    if unit == "lines/s":
        return f"{v / 1e6:.2f} M"
    if unit == "GB/s":
        return f"{v:.3f}"
    if unit == "KiB":
        return f"{v:.2f}"
    if unit == "MiB":
        return f"{v:.1f}"
    if unit == "steps":
        return f"{v:g}"
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def cell(s, unit):
    if not s:
        return "–"
    if len(s["samples"]) == 1:
        return fmt(s["median"], unit)
    return f"**{fmt(s['median'], unit)}** ({fmt(s['min'], unit)}–{fmt(s['max'], unit)}, n={len(s['samples'])})"


def ratio(r):
    return f"{r['ratio']:.1f}x" if r.get("ratio") else "–"


def target(r):
    t = r.get("target")
    if not t:
        return ""
    on = t.get("on", "median")
    v = t["value"]
    shown = f"{v:.0%}" if on == "overhead" else (f"{v:g}x" if on == "ratio" else f"{v:g}")
    return f"{'met' if t['met'] else 'NOT met'} ({on} {t['op']} {shown})"


def param_text(p):
    return ", ".join(f"{k} = {v:,}" if isinstance(v, int) else f"{v}" for k, v in p.items())


def table(case):
    rows = case["rows"]
    unit = rows[0]["unit"]
    better = "higher is better" if rows[0]["better"] == "higher" else "lower is better"
    out = [f"| case | mglaunch ({unit}) | torchrun / reference ({unit}) | advantage | target |", "|---|---|---|---|---|"]
    for r in rows:
        name = param_text(r["param"]) or "–"
        if r.get("note"):
            name += f" ({r['note']})"
        if r.get("cpu_ms"):
            c = r["cpu_ms"]
            name += f"; CPU {c['ours']:.1f} ms" + (f" vs {c['peer']:,.0f} ms" if c.get("peer") else "")
        if r.get("check"):
            c = r["check"]
            name += f"; check: {c['lines_ok']:,} of {c['lines_expected']:,} lines in order, {c['bad_lines']} bad " \
                    f"({'passed' if c['passed'] else 'FAILED'})"
        out.append(f"| {name} | {cell(r['ours'], r['unit'])} | {cell(r['peer'], r['unit'])} | {ratio(r)} | "
                   f"{target(r)} |")
    out.append(f"\n({better}; median in bold, range and sample count after it; advantage = how many times "
               "better mglaunch's median is)")
    return "\n".join(out)


def allreduce_table(case):
    out = ["| world | bytes | mgtrain busbw (GB/s) | Python loop busbw (GB/s) | mgtrain time / Python time − 1 | target |",
           "|---|---|---|---|---|---|"]
    for r in case["rows"]:
        p = r["param"]
        out.append(f"| {p['world']} | {p['bytes']:,} | {fmt(r['ours']['median'], 'GB/s')} | "
                   f"{fmt(r['peer']['median'] if r['peer'] else None, 'GB/s')} | {r['overhead']:+.1%} | {target(r)} |")
    method = case.get("method", "medians of 3 alternating runs of 20 timed all-reduces each")
    out.append(f"\n({method}; negative: mgtrain faster)")
    return "\n".join(out)


PLOTS = {
    "launch_exit": ("bench_launch.png", "launch → exit of N × /bin/true", "workers N", "ms (log)", True),
    "rdzv_agents": ("bench_rdzv.png", "K loopback agents: start → all workers started", "agents K", "ms (log)", True),
    "allreduce": ("bench_allreduce.png", "Gloo all-reduce bus bandwidth", "message bytes (log)", "GB/s", False),
    "relay": ("bench_relay.png", "log relay, 4 workers", "", "million lines/s", False),
}


def plot(name, case, docs, tmp):
    png, title, xl, yl, logy = PLOTS[name]
    data = os.path.join(tmp, name + ".dat")
    script = [f"set terminal pngcairo size 720,420 noenhanced font 'sans,10'" if has_cairo() else
              "set terminal png size 720,420 noenhanced",
              f"set output '{os.path.join(docs, png)}'", f"set title '{title}'", "set key top left",
              "set grid", f"set xlabel '{xl}'", f"set ylabel '{yl}'"]
    rows = case["rows"]
    if name in ("launch_exit", "rdzv_agents"):
        key = "N" if name == "launch_exit" else "K"
        with open(data, "w") as f:
            for r in rows:
                peer = r["peer"]["median"] if r["peer"] else "NaN"
                f.write(f"{r['param'][key]} {r['ours']['median']} {peer}\n")
        script += ["set logscale x 2", "set logscale y", "set style data linespoints",
                   f"plot '{data}' using 1:2 title 'mglaunch' lw 2, '' using 1:3 title 'torchrun' lw 2"]
    elif name == "allreduce":
        plots = []
        for world in (2, 4):
            d = f"{data}.{world}"
            with open(d, "w") as f:
                for r in rows:
                    if r["param"]["world"] == world:
                        f.write(f"{r['param']['bytes']} {r['ours']['median']} "
                                f"{r['peer']['median'] if r['peer'] else 'NaN'}\n")
            plots += [f"'{d}' using 1:2 title 'mgtrain, {world} ranks' lw 2",
                      f"'{d}' using 1:3 title 'Python loop, {world} ranks' lw 2 dt 2"]
        script += ["set logscale x 2", "set format x '%.0b %BB'", "set style data linespoints", "plot " + ", ".join(plots)]
    elif name == "relay":
        r0, r1 = rows
        with open(data, "w") as f:
            f.write(f"\"mglaunch\" {r0['ours']['median'] / 1e6}\n")
            if r0["peer"]:
                f.write(f"\"torchrun --tee 3\" {r0['peer']['median'] / 1e6}\n")
            f.write(f"\"/dev/null (limit)\" {r1['peer']['median'] / 1e6}\n")
        script += ["set style data histograms", "set style fill solid 0.7", "set boxwidth 0.6", "unset key",
                   "set yrange [0:*]", f"plot '{data}' using 2:xtic(1) lc rgb '#3060c0'"]
    gp = os.path.join(tmp, name + ".gp")
    with open(gp, "w") as f:
        f.write("\n".join(script) + "\n")
    subprocess.run(["gnuplot", gp], check=True, timeout=120)
    return png


_cairo = None


def has_cairo():
    global _cairo
    if _cairo is None:
        r = subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True)
        _cairo = "pngcairo" in (r.stdout + r.stderr)
    return _cairo


def portable(text):
    """`text` with the peer written as a checkout has it (../shared/peers/torchrun), never as
    the absolute path of the machine that ran the benchmark (results from before bench.py
    recorded it so have one)."""
    return re.sub(r"(?<![\w.])/[^\s`'()]*/shared/peers/torchrun", "../shared/peers/torchrun", text) if text else text


def render(res, docs, docs_rel):
    m = res["meta"]
    v = m["versions"]
    out = [f"Generated by `make bench` (bench/bench.py, then bench/render.py) from "
           f"`bench/results/latest.json` — do not edit by hand.",
           "",
           f"Run: {m['date']} on {m['machine']}, {m['cores']} cores, Linux {m['kernel']}; mglaunch {v['mglaunch']}, "
           f"torch {v['torch (peer and Python loops)']}, {v['hyperfine']}, {v.get('compiler') or v.get('gcc')}, {v['python']}. "
           f"Load average {m['load_at_start']:.1f} at the start, {m.get('load_at_end', 0):.1f} at the end"
           + (" — the machine was shared with other jobs, so absolute times are noisy; "
              "both tools ran in the same run, alternating" if max(m['load_at_start'], m.get('load_at_end', 0)) > 1.0
              else "") + ".",
           "",
           f"Peer: `{portable(m['peer']) or 'none'}` — {portable(m['peer_note'])}. The peer is `$TORCHRUN`, else `torchrun` on PATH, else "
           "`../shared/peers/torchrun`, always with `--monitor_interval=0.1`; one that cannot run `--tee 3` is "
           "skipped." + (" **Quick run (BENCH_QUICK=1): one sample per case, smaller sizes.**" if m["quick"] else ""),
           ""]
    if m.get("earlier"):  # cases kept from an earlier run (bench.py --cases merged into the file)
        e = m["earlier"]
        out += [f"Cases not run again in this run, from the run of {e['date']} (mglaunch {e['mglaunch']}): "
                + ", ".join(f"`{c}`" for c in e["cases"]) + ".", ""]
    out += ["#### Guardrails (issue #24)",
           "",
           guardrails_table(res),
           ""]
    plots = []
    for n, (name, case) in enumerate(res["cases"].items(), 1):
        if "skipped" in case or "error" in case:
            out += [f"#### ({n}) {name}", "", f"Not measured: {case.get('skipped') or case.get('error')}", ""]
            continue
        out += [f"#### ({n}) {case['title']}", ""]
        if case.get("run"):  # measured alone, merged into this file (bench.py --merge)
            r = case["run"]
            out += [f"Measured in its own run of {r['date']} (mglaunch {r['mglaunch']}, load average "
                    f"{r['load_at_start']:.1f} at the start, {r['load_at_end']:.1f} at the end"
                    + (", quick" if r.get("quick") else "") + "), merged into this file.", ""]
        if name == "allreduce":
            out.append(allreduce_table(case))
        elif "rows" in case and name != "training" and case["rows"]:
            out.append(table(case))
        if case.get("text"):
            text = case["text"].rstrip()
            out += ["", text if text.lstrip().startswith("|") else "```\n" + text + "\n```"]
        out.append("")
        if name in PLOTS and docs and case.get("rows"):
            try:
                png = plot(name, case, docs, render.tmp)
                out += [f"![{PLOTS[name][1]}]({png if docs_rel == '.' else docs_rel + '/' + png})", ""]
                plots.append(png)
            except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
                out += [f"(plot failed: {e})", ""]
    return "\n".join(out).rstrip() + "\n", plots


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "latest.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                   help="the page with the bench markers (default docs/benchmarks.md)")
    p.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                   help="the page with the headline markers (default README.md)")
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="where the plots go")
    a = p.parse_args()
    with open(a.json) as f:
        res = json.load(f)
    if not shutil.which("gnuplot"):
        print("render: gnuplot not found (apt-get install gnuplot-nox): no plots", file=sys.stderr)
        docs = None
    else:
        docs = a.docs
        os.makedirs(docs, exist_ok=True)
    docs_rel = os.path.relpath(a.docs, os.path.dirname(os.path.abspath(a.out)))
    render.tmp = tempfile.mkdtemp(prefix="mgrender_")
    try:
        text, plots = render(res, docs, docs_rel)
    finally:
        shutil.rmtree(render.tmp, ignore_errors=True)
    if not splice(a.out, BEGIN, END, text):
        print(f"render: {a.out} has no {BEGIN} ... {END} markers; add them where the tables go", file=sys.stderr)
        return 2
    print(f"render: {a.out} updated; plots: {', '.join(plots) or 'none'}", file=sys.stderr)
    if os.path.exists(a.readme) and splice(a.readme, HEAD_BEGIN, HEAD_END, headline(res)):
        print(f"render: {a.readme} headline updated", file=sys.stderr)
    else:
        print(f"render: {a.readme} has no {HEAD_BEGIN} ... {HEAD_END} markers: no headline written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
