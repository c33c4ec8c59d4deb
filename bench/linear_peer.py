#!/usr/bin/env python3
"""The peer of causal linear attention: the authors' chunked kernel of flash-linear-attention
(`fla.ops.linear_attn.chunk_linear_attn`, normalize=True; the feature map elu+1 is applied to q
and k before the timed call), forward and forward + backward, on the shapes of bench_linear_cuda's
causal rows. Prints the ratio table and the memory floor against that benchmark's JSON output.

    bench_linear_cuda --benchmark_filter='copy|linear_causal' --benchmark_out=linear.json \
        --benchmark_out_format=json
    python3 bench/linear_peer.py linear.json > table.md

Rows read: `linear_causal/B:../T:../H:..` (forward) and
`linear_causal_forward_backward/B:../T:../H:..`, D = 64. Run it in the same call as the benchmark.
"""
import json
import sys

from sdpa_peer import print_floor, shaped_rows, time_ms


def fla_ms(B, T, H, D, backward):
    """The authors' chunked causal linear attention, or None when fla does not import."""
    try:
        import torch
        import torch.nn.functional as F
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k = F.elu(q) + 1, F.elu(k) + 1
    if backward:
        for x in (q, k, v):
            x.requires_grad_()
        step = lambda: chunk_linear_attn(q, k, v, normalize=True)[0].backward(do)  # noqa: E731
    else:
        step = lambda: chunk_linear_attn(q, k, v, normalize=True)  # noqa: E731
    ms = time_ms(step)
    torch.cuda.empty_cache()
    return ms


def main():
    import torch

    # A row as soon as it is timed: the authors' first backward compiles for minutes, and a call
    # that runs out of time keeps the rows before it.
    sys.stdout.reconfigure(line_buffering=True)
    benchmarks = [b for path in sys.argv[1:] for b in json.load(open(path))["benchmarks"]]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print()
    print("| kernel | B | T | H | attnmix ms | fla chunk ms | attnmix / fla |")
    print("|---|---|---|---|---|---|---|")
    for kind, B, T, H, ms, _ in shaped_rows(benchmarks):
        if kind not in ("linear_causal", "linear_causal_forward_backward"):
            continue
        peer = fla_ms(B, T, H, 64, kind.endswith("backward"))
        if peer is None:
            print(f"| {kind} | {B} | {T} | {H} | {ms:.3f} | (fla does not import) | |")
        else:
            print(f"| {kind} | {B} | {T} | {H} | {ms:.3f} | {peer:.3f} | {ms / peer:.2f} |")
    print_floor(benchmarks)


if __name__ == "__main__":
    main()
