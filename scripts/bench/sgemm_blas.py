#!/usr/bin/env python3
"""sgemm GFLOP/s of two BLAS libraries at the 0.5B forward's projection
shapes, for comparison with `cargo xtask bench --matmul-only` (candle's gemm
through the forward's own code path) on the same machine.

MKL is loaded with ctypes from the PyPI `mkl` wheel's libmkl_rt (with
`intel-openmp`'s libiomp5 beside it); OpenBLAS is numpy's. Two threads,
median of 7 after a warm-up. Prints one JSON list on stdout.

    pip download --no-deps -d wheels mkl intel-openmp
    (unzip both; put libmkl_rt.so.3, libmkl_core, libmkl_intel_thread,
     libmkl_intel_lp64, the CPU-specific libmkl_* and libiomp5.so in one folder)
    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 python3 scripts/bench/sgemm_blas.py LIBDIR/libmkl_rt.so.3
"""
import ctypes
import json
import statistics
import sys
import time

import numpy as np

SHAPES = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728),
          ("down", 4864, 896), ("lm_head", 896, 151936)]


def main(mkl_path):
    lib = ctypes.CDLL(mkl_path, mode=ctypes.RTLD_GLOBAL)
    lib.MKL_Set_Num_Threads(2)
    fp = ctypes.POINTER(ctypes.c_float)

    def mkl(x, w, y):
        m, k = x.shape
        n = w.shape[0]
        # C = X Wᵀ, row major: (RowMajor=101, NoTrans=111, Trans=112)
        lib.cblas_sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0),
                        x.ctypes.data_as(fp), k, w.ctypes.data_as(fp), k,
                        ctypes.c_float(0.0), y.ctypes.data_as(fp), n)

    def openblas(x, w, y):
        np.matmul(x, w.T, out=y)

    rows_of = {"lm_head": [1]}
    out = []
    for name, k, n in SHAPES:
        w = np.random.randn(n, k).astype(np.float32)
        for rows in rows_of.get(name, [300, 16, 1]):
            x = np.random.randn(rows, k).astype(np.float32)
            y = np.empty((rows, n), np.float32)
            for backend, f in [("mkl", mkl), ("openblas", openblas)]:
                f(x, w, y)
                ts = []
                for _ in range(7):
                    t = time.perf_counter()
                    f(x, w, y)
                    ts.append(time.perf_counter() - t)
                t = statistics.median(ts)
                g = 2 * rows * k * n / t / 1e9
                out.append(dict(backend=backend, product=name, rows=rows,
                                seconds=t, gflop_per_s=g))
                print(f"{backend} {name} {rows}x{k}->{n}: {t * 1e3:.2f} ms, "
                      f"{g:.1f} GFLOP/s", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
