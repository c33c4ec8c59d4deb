#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention (cuDNN and flash backends) on the shapes of
bench_attention_cuda and prints the ratio table against that benchmark's JSON output.

    bench_attention_cuda --benchmark_out=sa.json --benchmark_out_format=json
    bench_linear_cuda --benchmark_out=linear.json --benchmark_out_format=json
    python3 bench/sdpa_peer.py sa.json linear.json > table.md

With bench_linear_cuda's JSON (which holds BM_copy) it also prints each linear kernel against its
memory floor: the bytes a call must move over the copy bandwidth of the same run.

Run both in the same call on the same GPU: a figure from another run is not a comparison.
"""
import json
import re
import sys


def time_ms(fn, warmup=5, reps=30):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def sdpa_ms(backend, B, T, H, D, causal, calls=1):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def chain():
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with sdpa_kernel([backend]):
        return time_ms(chain) / calls


def shaped_rows(benchmarks):
    """(kind, B, T, H, ms, MB or None) of each benchmark named kind/B:../T:../H:..; the medians
    where the run had repetitions (--benchmark_repetitions)."""
    rows = []
    medians = [b for b in benchmarks if b.get("aggregate_name") == "median"]
    for b in medians or benchmarks:
        m = re.match(r"(\w+)/B:(\d+)/T:(\d+)/H:(\d+)", b.get("run_name", b["name"]))
        if not m or (not medians and b.get("run_type") == "aggregate"):
            continue
        kind, B, T, H = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        ms = b["real_time"] if b["time_unit"] == "ms" else b["real_time"] / 1e6
        rows.append((kind, B, T, H, ms, b.get("MB")))
    return rows


def print_floor(benchmarks):
    """The memory-floor table of the benchmarks with an MB counter (the bytes a call must move),
    against the copy bandwidth that BM_copy measured in the same run (bytes read + written)."""
    copies = [b["GB/s"] for b in benchmarks if b["name"].startswith("BM_copy") and "GB/s" in b]
    rows = [r for r in shaped_rows(benchmarks) if r[5] is not None]
    if not copies or not rows:
        return
    tbs = max(copies) / 1e3
    print()
    print(f"memory floor: the call's bytes over the copy's {tbs:.3f} TB/s (BM_copy, same run)")
    print()
    print("| kernel | B | T | H | MB | attnmix ms | floor ms | attnmix / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, B, T, H, ms, mb in rows:
        floor = mb / tbs / 1e3
        print(f"| {kind} | {B} | {T} | {H} | {mb:.1f} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f} |")


def main():
    import torch
    from torch.nn.attention import SDPBackend

    benchmarks = [b for path in sys.argv[1:] for b in json.load(open(path))["benchmarks"]]
    rows = [r[:5] for r in shaped_rows(benchmarks)]
    peers = {}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print()
    print("| kernel | B | T | H | D | attnmix ms | cuDNN ms | flash ms | attnmix / cuDNN | attnmix / flash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, B, T, H, ms in rows:
        # Bidirectional SA is the peer of BLA/GBLA; a row named ..._chainN times N calls back to
        # back (per call), and so does its peer.
        chain = re.search(r"_chain(\d+)$", kind)
        calls = int(chain.group(1)) if chain else 1
        causal = kind[: chain.start()].endswith("_causal") if chain else kind.endswith("_causal")
        key = (B, T, H, causal, calls)
        if key not in peers:
            peers[key] = (sdpa_ms(SDPBackend.CUDNN_ATTENTION, B, T, H, 64, causal, calls),
                          sdpa_ms(SDPBackend.FLASH_ATTENTION, B, T, H, 64, causal, calls))
            torch.cuda.empty_cache()
        cudnn, flash = peers[key]
        print(f"| {kind} | {B} | {T} | {H} | 64 | {ms:.3f} | {cudnn:.3f} | {flash:.3f} | "
              f"{ms / cudnn:.2f} | {ms / flash:.2f} |")
    print_floor(benchmarks)


if __name__ == "__main__":
    main()
