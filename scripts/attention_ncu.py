"""The production attention at each bench shape, launched a few times eagerly, for a profiler.

Why: `ncu` (or nsys) wants a short process whose kernel launches it can count. bench_kernels
times CUDA-graph replays of hundreds of launches; this launches the op `--launches` times per
shape (the first compiles and plans), shape after shape in bench_kernels' order, so a profiler
filtering on the kernel's name sees the same count per shape. Prints each shape's launch indices
and the kernel in force.

Usage (CUDA): ncu --kernel-name regex:attention_kernel --csv --page details \
    python3 -m hstu.scripts.attention_ncu --shapes batch8 rerank8
"""

from __future__ import annotations

import argparse

import torch

from hstu.ops import triton_attention as ta
from hstu.scripts.bench_kernels import (ATTENTION_SHAPES, CANDIDATES, DTYPE, HEAD_DIM, HEADS, HISTORY, LAYERS, PAGE,
                                        seed_metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = [name for name, _ in ATTENTION_SHAPES]
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument("--launches", type=int, default=2, help="launches per shape (the first compiles)")
    args = parser.parse_args()
    torch.manual_seed(0)
    num_pages = 4096
    cache = torch.randn((LAYERS, num_pages, 2, PAGE, HEADS, HEAD_DIM), device="cuda").to(DTYPE)
    index = 0
    for name, users in ATTENTION_SHAPES:
        if name not in args.shapes:
            continue
        meta = seed_metadata(users, num_pages)
        T = int(meta.q_pos.shape[0])
        q, k, v = (torch.randn((T, HEADS, HEAD_DIM), device="cuda", dtype=DTYPE) for _ in range(3))
        for i in range(args.launches):
            ta.paged_hstu_attention_triton(q, k, v, cache, (i + 1) % LAYERS, meta, HISTORY + CANDIDATES)
        torch.cuda.synchronize()
        print(f"{name}: launches {index}..{index + args.launches - 1} ({ta.kernel_in_force(q.device)})", flush=True)
        index += args.launches


if __name__ == "__main__":
    main()
