"""Benchmark DTensorFastEmaModelUpdater.update_average against per-parameter EMA loops.

Builds the parameter shapes of a GPT-style model (~110M fp32 parameters by default) on
the CPU, times the updater's foreach update against two per-parameter loops measured
in the same run (interleaved, so machine load hits every variant alike), and reports
bytes moved per second against a plain copy of the same bytes. Figures are ratios to
baselines of this run; no absolute time is asserted.

    python scripts/bench_ema.py [--layers 12] [--dim 768] [--vocab 32000] [--repeats 7]
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
from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater

BETA = 0.9999


def gpt_shapes(layers: int, dim: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-style decoder (tied head)."""
    per_layer = [
        (dim,),
        (dim,),
        (3 * dim, dim),
        (3 * dim,),
        (dim, dim),
        (dim,),
        (dim,),
        (dim,),
        (4 * dim, dim),
        (4 * dim,),
        (dim, 4 * dim),
        (dim,),
    ]
    return [(vocab, dim), (1024, dim)] + per_layer * layers + [(dim,), (dim,)]


def loop_inplace(ema: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The usual hand-written loop: two in-place kernels per parameter."""
    for e, s in zip(ema, src):
        e.mul_(BETA).add_(s, alpha=1 - BETA)


def loop_classic(ema: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The common allocating loop (``e.copy_(beta * e + (1 - beta) * s)``)."""
    for e, s in zip(ema, src):
        e.copy_(BETA * e + (1 - BETA) * s)


def timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, interleaved round by round so machine load hits all alike."""
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults and allocator growth
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shapes = gpt_shapes(args.layers, args.dim, args.vocab)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(s, generator=gen) for s in shapes]
    ema = [torch.randn(s, generator=gen) for s in shapes]
    n = sum(t.numel() for t in src)
    updater = DTensorFastEmaModelUpdater()

    samples = timed(
        {
            "foreach update_average": lambda: updater.update_average(src, ema, beta=BETA),
            "per-param loop, mul_+add_": lambda: loop_inplace(ema, src),
            "per-param loop, copy_(b*e+(1-b)*s)": lambda: loop_classic(ema, src),
            "plain copy of the same bytes": lambda: torch._foreach_copy_(ema, src),
        },
        args.repeats,
    )
    moved = {name: 3 * 4 * n for name in samples}  # EMA: read ema, read src, write ema
    moved["plain copy of the same bytes"] = 2 * 4 * n  # read src, write ema
    best = {name: min(v) for name, v in samples.items()}
    median = {name: statistics.median(v) for name, v in samples.items()}
    fast, inplace, classic, copy = best.values()

    print(
        f"torch {torch.__version__}, {args.threads} threads, {len(shapes)} tensors, "
        f"{n / 1e6:.1f}M fp32 params, {args.repeats} interleaved rounds"
    )
    print(f"{'update':36s} {'best s':>8s} {'median s':>9s} {'GB/s':>7s} {'x fast':>8s}")
    for name in samples:
        print(
            f"{name:36s} {best[name]:8.4f} {median[name]:9.4f} "
            f"{moved[name] / best[name] / 1e9:7.2f} "
            f"{best[name] / fast:7.2f}x"
        )
    print(
        f"speed-up of update_average (best of rounds): {inplace / fast:.2f}x vs the mul_+add_ "
        "loop, "
        f"{classic / fast:.2f}x vs the allocating loop "
        f"(medians: {median['per-param loop, mul_+add_'] / median['foreach update_average']:.2f}x, "
        f"{median['per-param loop, copy_(b*e+(1-b)*s)'] / median['foreach update_average']:.2f}x)"
    )
    ema_rate, copy_rate = 3 * 4 * n / fast, 2 * 4 * n / copy
    print(
        f"bytes moved per second: update_average {ema_rate / 1e9:.2f} GB/s, plain copy "
        f"{copy_rate / 1e9:.2f} GB/s, ratio {ema_rate / copy_rate:.2f}"
    )


if __name__ == "__main__":
    main()
