#!/usr/bin/env python3
"""Where a kernel's warps wait: the lines (or SASS instructions) of an Nsight Compute source page
with the most stall samples, each with its main stall reasons.

    ncu --clock-control none -k regex:<kernel> -c 1 --section WarpStateStats \
        --section SourceCounters --import-source yes -o /tmp/k <program> <args>
    ncu -i /tmp/k.ncu-rep --page source --print-source cuda --csv > /tmp/k.csv
    python3 bench/ncu_stalls.py /tmp/k.csv [rows]

Build the program with -lineinfo, and on the machine that profiles keep the headers at the path
they were compiled from (--import-source reads them there); `--print-source sass` needs neither.
The page's first row may name the kernel: the header is the first row that has a `Source` column.
"""
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if at is None:
        sys.exit(f"no header with 'Source' and '{SAMPLES}' in {sys.argv[1]}")
    head = rows[at]
    data = [r for r in rows[at + 1:] if len(r) == len(head)]
    where, source, samples = head[0], head.index("Source"), head.index(SAMPLES)
    stalls = [i for i, name in enumerate(head) if name.startswith("stall_")]
    total = sum(number(r[samples]) for r in data) or 1.0
    print(f"{len(data)} rows, {total:.0f} samples")
    reasons = {head[i][6:]: sum(number(r[i]) for r in data) for i in stalls}
    print("by reason: " + ", ".join(f"{k} {v / total * 100:.1f} %"
                                    for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
                                    if v >= 0.005 * total))
    for r in sorted(data, key=lambda r: -number(r[samples]))[:top]:
        n = number(r[samples])
        if n == 0:
            break
        why = ", ".join(f"{head[i][6:]} {number(r[i]) / n * 100:.0f} %"
                        for i in sorted(stalls, key=lambda i: -number(r[i]))
                        if number(r[i]) >= 0.1 * n)
        print(f"{n / total * 100:5.2f} %  {where} {r[0]:>8}  {r[source].strip()[:100]}  [{why}]")


if __name__ == "__main__":
    main()
