#!/usr/bin/env python3
"""Writes the chaos soak's reports (tests/chaos.py --report, `make chaos`) into the README
between `<!-- chaos:begin -->` and `<!-- chaos:end -->`: per backend and fault kind, how many
faults were injected and survived, the time from the fault to its detection and to the first
step completed after it (median, 90th percentile, max), and the steps lost.

  render_chaos.py [--readme README.md] REPORT.json...
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"


def pct(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def s(v):
    return "–" if v is None else f"{v:.2f}"


def rows(report):
    by_kind = {}
    for f in report.get("faults", []):
        by_kind.setdefault(f["kind"], []).append(f)
    out = []
    for kind, fs in sorted(by_kind.items()):
        det = [f["detected_s"] for f in fs if f.get("detected_s") is not None]
        rec = [f["recovered_s"] for f in fs if f.get("recovered_s") is not None]
        lost = sum(f.get("steps_lost") or 0 for f in fs)
        out.append(f"| {report.get('backend', '?')} | {kind} | {len(fs)} | {len(rec)} | "
                   f"{s(statistics.median(det) if det else None)} | {s(statistics.median(rec) if rec else None)} | "
                   f"{s(pct(rec, 0.9))} | {s(max(rec) if rec else None)} | {lost} |")
    return out


def table(reports):
    lines = ["| backend | fault | injected | recovered | detect median (s) | recover median (s) | recover p90 (s) "
             "| recover max (s) | steps lost |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in reports:
        lines += rows(r)
        problems = r.get("problems") or []
        end = r.get("unsurvivable") or {}
        notes.append(f"* {r.get('backend', '?')}: {r.get('seconds', '?')} s, seed {r.get('seed', '?')}, "
                     f"{len(r.get('faults', []))} faults; "
                     + ("every check held (identical weights on every rank, no process or temporary file left)"
                        if not problems else "FAILED: " + "; ".join(problems[:3]))
                     + (f"; the unsurvivable fault ended the job with exit {end.get('exit_code')} in {s(end.get('seconds'))} s"
                        if isinstance(end, dict) and end.get("exit_code") is not None else ""))
    return "\n".join(lines + [""] + notes)


def splice(path, text):
    with open(path) as f:
        page = f.read()
    i, j = page.find(BEGIN), page.find(END)
    if i < 0 or j < i:
        return False
    with open(path, "w") as f:
        f.write(page[:i + len(BEGIN)] + "\n" + text + "\n" + page[j:])
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("reports", nargs="+")
    a = ap.parse_args()
    reports = []
    for p in a.reports:
        try:
            with open(p) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:  # the soak died before its report: say so in the README
            print(f"render_chaos: cannot read {p}: {e}", file=sys.stderr)
            reports.append({"backend": os.path.basename(p), "problems": [f"no report ({type(e).__name__})"]})
    text = table(reports)
    if not splice(a.readme, text):
        print(f"render_chaos: {a.readme} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
