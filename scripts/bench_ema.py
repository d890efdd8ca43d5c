"""Benchmark DTensorFastEmaModelUpdater.update_average against per-parameter EMA loops.

Builds the parameter shapes of a GPT-style model (~110M fp32 parameters by default) on
the CPU, times the updater's foreach update against two per-parameter loops measured
in the same run, and reports bytes moved per second against a plain copy of the same
bytes. Figures are ratios to baselines of this run; no absolute time is asserted.

    python scripts/bench_ema.py [--layers 12] [--dim 768] [--vocab 32000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater  # noqa: E402

BETA = 0.9999


def gpt_shapes(layers: int, dim: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-style decoder (tied head)."""
    per_layer = [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,),
                 (dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]
    return [(vocab, dim), (1024, dim)] + per_layer * layers + [(dim,), (dim,)]


def loop_inplace(ema: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The usual hand-written loop: two in-place kernels per parameter."""
    for e, s in zip(ema, src):
        e.mul_(BETA).add_(s, alpha=1 - BETA)


def loop_classic(ema: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The common allocating loop (``e.copy_(beta * e + (1 - beta) * s)``)."""
    for e, s in zip(ema, src):
        e.copy_(BETA * e + (1 - BETA) * s)


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and allocator growth
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shapes = gpt_shapes(args.layers, args.dim, args.vocab)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(s, generator=gen) for s in shapes]
    ema = [torch.randn(s, generator=gen) for s in shapes]
    n = sum(t.numel() for t in src)
    updater = DTensorFastEmaModelUpdater()

    t_fast = timed(lambda: updater.update_average(src, ema, beta=BETA), args.repeats)
    t_inplace = timed(lambda: loop_inplace(ema, src), args.repeats)
    t_classic = timed(lambda: loop_classic(ema, src), args.repeats)
    t_copy = timed(lambda: torch._foreach_copy_(ema, src), args.repeats)

    ema_bytes = 3 * 4 * n   # read ema, read src, write ema
    copy_bytes = 2 * 4 * n  # read src, write ema
    gbps = lambda b, t: b / t / 1e9  # noqa: E731

    print(f"torch {torch.__version__}, {args.threads} threads, {len(shapes)} tensors, {n / 1e6:.1f}M fp32 params")
    print(f"{'update':34s} {'median s':>9s} {'GB/s':>7s} {'speed-up':>9s}")
    for name, t, b in [
        ("foreach update_average", t_fast, ema_bytes),
        ("per-param loop, mul_+add_", t_inplace, ema_bytes),
        ("per-param loop, copy_(b*e+(1-b)*s)", t_classic, ema_bytes),
        ("plain copy of the same bytes", t_copy, copy_bytes),
    ]:
        print(f"{name:34s} {t:9.4f} {gbps(b, t):7.2f} {t_inplace / t:8.2f}x")
    print(f"speed-up vs mul_+add_ loop: {t_inplace / t_fast:.2f}x; vs allocating loop: {t_classic / t_fast:.2f}x")
    print(f"EMA bandwidth / plain-copy bandwidth: {gbps(ema_bytes, t_fast) / gbps(copy_bytes, t_copy):.2f}")


if __name__ == "__main__":
    main()
