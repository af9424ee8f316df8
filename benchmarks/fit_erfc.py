"""Fit of the erf GELU's tail polynomial in kprof.kernels.glu (`_ERFC_P`, `_P0`..`_P7`).

    python -m benchmarks.fit_erfc [--degree 7]          (needs numpy and scipy; CPU, ~1 min)

h = Phi(-|g|) = 0.5 erfc(z), z = |g| / sqrt(2), is written as t * P(t) * phi(g) with
t = 1 / (1 + p z): P(t) = 0.5 sqrt(2 pi) erfcx(z) / t, smooth on t in (0, 1] (-> 1 / (2 sqrt(pi))
as z -> inf). P minimizes the maximum RELATIVE error over z in [0, 9.5] (past it phi(g) is below
2^-126 and ex2.approx.ftz flushes the product to 0): Lawson's iteratively reweighted least
squares on a Chebyshev-clustered grid in t, with p chosen by a bounded scalar search around it.
Result (2026-11-30): degree 6: 5.3e-7 (p 0.373); 7: 8.4e-8 (p 0.430, the kernels' choice, under
Numerical Recipes' erfcc 1.2e-7 that it replaced); 8: 1.8e-8 (p 0.487).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

K = 0.5 * math.sqrt(2 * math.pi)


def lawson(degree: int, p: float, zmax: float = 9.5, iters: int = 200, n: int = 40000):
    """(coefficients c0..c_degree, max relative error) of the fit for this p."""
    from scipy.special import erfcx

    tmin = 1 / (1 + p * zmax)
    t = tmin + (1 - tmin) * (np.cos(np.linspace(0, math.pi, n)) + 1) / 2
    f = K * erfcx((1 / t - 1) / p) / t
    vander = np.vander(t, degree + 1, increasing=True)
    w = np.full_like(t, 1 / n)
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(vander * (sw / f)[:, None], sw, rcond=None)
        err = (vander @ c - f) / f
        w = w * np.abs(err)
        w /= w.sum()
    return c, float(np.abs(err).max())


def main(argv=None) -> int:
    from scipy.optimize import minimize_scalar

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--degree", type=int, default=7)
    args = ap.parse_args(argv)
    res = minimize_scalar(lambda p: lawson(args.degree, p, iters=60)[1], bounds=(0.2, 1.2), method="bounded",
                          options={"xatol": 1e-3})
    c, err = lawson(args.degree, res.x, iters=300)
    print(f"degree {args.degree}: p = {float(res.x)!r}, max relative error {err:.3g}")
    print("coefficients c0..cn:", ", ".join(repr(float(v)) for v in c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
