#!/usr/bin/env python3
"""Forward + backward peers of the training benchmarks: PyTorch autograd over
scaled_dot_product_attention (cuDNN and flash backends) and, when `fla` imports, the authors' PaTH
and FoX kernels (fla-core). Prints the ratio table against the benchmarks' JSON output.

    bench_attention_cuda --benchmark_filter=fwd_bwd --benchmark_out=sa.json --benchmark_out_format=json
    bench_path_cuda --benchmark_filter=fwd_bwd --benchmark_out=path.json --benchmark_out_format=json
    python3 bench/train_peer.py sa.json path.json > table.md

A benchmark row is read when its name is `<kind>_fwd_bwd[_causal]/B:<B>/T:<T>/H:<H>[/D:<D>]`
(D = 64 when absent) with kind one of softmax, fox, path, path_fox. With no arguments the script
prints the peers alone at the shapes of the backward goals. Run it in the same call as the
benchmarks, on the same GPU: a figure from another run is not a comparison.
"""
import json
import re
import sys

from sdpa_peer import time_ms

GOAL_SHAPES = [(32, 2048, 32, 64), (32, 4096, 32, 64), (8, 8192, 32, 64), (4, 16384, 32, 64),
               (8, 4096, 16, 128), (2, 16384, 16, 128)]


def _grad_inputs(B, T, H, D, layout):
    import torch

    shape = (B, H, T, D) if layout == "bhtd" else (B, T, H, D)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return q, k, v, do


def sdpa_fwd_bwd_ms(backend, B, T, H, D, causal):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v, do = _grad_inputs(B, T, H, D, "bhtd")

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)

    with sdpa_kernel([backend]):
        return time_ms(step)


def fla_fwd_bwd_ms(kind, B, T, H, D):
    """The authors' kernels, or None when fla does not import. PaTH takes float32 w, beta and g."""
    try:
        import torch
        import torch.nn.functional as F
        from fla.ops.forgetting_attn import parallel_forgetting_attn
        from fla.ops.path_attn import parallel_path_attn
    except ImportError:
        return None
    q, k, v, do = _grad_inputs(B, T, H, D, "bthd")
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")).requires_grad_()
    if kind == "fox":
        step = lambda: parallel_forgetting_attn(q, k, v, g.bfloat16()).backward(do)  # noqa: E731
    else:
        w = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).requires_grad_()
        beta = (2 * torch.rand(B, T, H, device="cuda")).requires_grad_()
        gate = g if kind == "path_fox" else None
        step = lambda: parallel_path_attn(q, k, v, w, beta, gate)[0].backward(do)  # noqa: E731
    return time_ms(step, warmup=3, reps=10)


ROW = re.compile(r"(softmax|fox|path_fox|path)_fwd_bwd(_causal)?/B:(\d+)/T:(\d+)/H:(\d+)(?:/D:(\d+))?")


def rows_of(benchmarks):
    rows = []
    for b in benchmarks:
        m = ROW.match(b["name"])
        if not m or b.get("run_type") == "aggregate":
            continue
        ms = b["real_time"] if b["time_unit"] == "ms" else b["real_time"] / 1e6
        kind, causal = m.group(1), m.group(2) is not None or m.group(1) != "softmax"
        B, T, H = (int(m.group(i)) for i in (3, 4, 5))
        rows.append((kind, causal, B, T, H, int(m.group(6) or 64), ms))
    return rows


def main():
    import torch
    from torch.nn.attention import SDPBackend

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}; forward + backward, bf16, medians")
    print()
    benchmarks = [b for path in sys.argv[1:] for b in json.load(open(path))["benchmarks"]]
    rows = rows_of(benchmarks)
    if not sys.argv[1:]:
        rows = [(kind, True, B, T, H, D, None) for B, T, H, D in GOAL_SHAPES
                for kind in ("softmax", "fox", "path", "path_fox")]
    peers = {}

    def peer(key, fn):
        if key not in peers:
            peers[key] = fn()
            torch.cuda.empty_cache()
        return peers[key]

    print("| kernel | B | T | H | D | attnmix ms | cuDNN ms | flash ms | authors' ms | attnmix / cuDNN | attnmix / authors' |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    for kind, causal, B, T, H, D, ms in rows:
        cudnn = peer(("cudnn", B, T, H, D, causal),
                     lambda: sdpa_fwd_bwd_ms(SDPBackend.CUDNN_ATTENTION, B, T, H, D, causal))
        flash = peer(("flash", B, T, H, D, causal),
                     lambda: sdpa_fwd_bwd_ms(SDPBackend.FLASH_ATTENTION, B, T, H, D, causal))
        authors = None
        if kind != "softmax":
            authors = peer((kind, B, T, H, D), lambda: fla_fwd_bwd_ms(kind, B, T, H, D))
        print(f"| {kind}{'_causal' if causal and kind == 'softmax' else ''} | {B} | {T} | {H} | {D} | "
              f"{fmt(ms)} | {fmt(cudnn)} | {fmt(flash)} | {fmt(authors)} | {ratio(ms, cudnn)} | "
              f"{ratio(ms, authors)} |")


if __name__ == "__main__":
    main()
