#!/usr/bin/env python3
"""Where a kernel's warps wait and what it executes, from an Nsight Compute source page: the
instructions (or lines) with the most stall samples and their main reasons; with the SASS page,
also the opcode mix and the kernel in ranges of consecutive instructions (a loop body shows as a
run of ranges with the same execution count).

    ncu --clock-control none -k regex:<kernel> -c 1 --section WarpStateStats \
        --section SourceCounters -o /tmp/k <program> <args>
    ncu -i /tmp/k.ncu-rep --page source --print-source sass --csv > /tmp/k.csv
    python3 bench/ncu_stalls.py /tmp/k.csv [rows] [--bins N]

The page's first row may name the kernel: the header is the first row that has a `Source` column.
`--print-source cuda` (with -lineinfo and --import-source) gives source lines, but its CSV may
carry no metrics; the SASS page always does.
"""
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    """The opcode of a SASS line without its predicate and modifiers: `@!P2 LDS.64 R4, [..]` -> LDS."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split()[0].split(".")[0] if text else "?"


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        sys.exit(__doc__)
    bins = 128
    if "--bins" in sys.argv:
        bins = int(sys.argv[sys.argv.index("--bins") + 1])
        args.remove(str(bins))
    rows = list(csv.reader(open(args[0], newline="")))
    top = int(args[1]) if len(args) > 1 else 40
    at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if at is None:
        sys.exit(f"no header with 'Source' and '{SAMPLES}' in {args[0]}")
    head = rows[at]
    data = [r for r in rows[at + 1:] if len(r) == len(head)]
    where, source, samples = head[0], head.index("Source"), head.index(SAMPLES)
    stalls = [i for i, name in enumerate(head)
              if name.startswith("stall_") and "Not Issued" not in name]
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

    if where != "Address" or EXECUTED not in head:
        return
    executed = head.index(EXECUTED)
    count = sum(number(r[executed]) for r in data) or 1.0
    ops, op_samples = collections.Counter(), collections.Counter()
    for r in data:
        ops[opcode(r[source])] += number(r[executed])
        op_samples[opcode(r[source])] += number(r[samples])
    print(f"\n{count:.3g} instructions executed; opcode: % of them / % of samples")
    print("  " + "  ".join(f"{o} {c / count * 100:.1f} / {op_samples[o] / total * 100:.1f}"
                           for o, c in ops.most_common(24)))
    print(f"\nranges of {bins} instructions with >= 0.5 % of either (first row, % instructions, "
          "% samples, most executions of one instruction, main opcodes):")
    for b in range(0, len(data), bins):
        part = data[b:b + bins]
        n_exec = sum(number(r[executed]) for r in part)
        n_samp = sum(number(r[samples]) for r in part)
        if n_exec < 0.005 * count and n_samp < 0.005 * total:
            continue
        mix = collections.Counter()
        for r in part:
            mix[opcode(r[source])] += number(r[executed])
        most = max(number(r[executed]) for r in part)
        main_ops = " ".join(f"{o} {c / max(n_exec, 1) * 100:.0f}" for o, c in mix.most_common(6))
        print(f"{b:6d} {n_exec / count * 100:5.2f} % {n_samp / total * 100:5.2f} % "
              f"{most:11.0f}  {main_ops}")


if __name__ == "__main__":
    main()
