"""How often `kiln fit`'s bootstrap intervals hold the true parameters: synthetic ladders from
Hoffmann et al. 2022's and Besiroglu et al. 2024's laws (5 sizes x 4 tokens-per-parameter
ratios, log-normal noise), fitted and bootstrapped many times; the share of intervals covering
the truth per parameter and scheme, and the fit's own error. docs/scaling.md quotes its output.

    python scripts/scaling_coverage.py --trials 60 --noise 0.01 --level 0.9 --resamples 300
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kiln.recipes.scaling import bootstrap, laws

LAWS = {"hoffmann": (1.69, 406.4, 410.7, 0.34, 0.28),
        "besiroglu": (1.82, 482.0, 2085.4, 0.3478, 0.3658)}


def ladder(law, sigma: float, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    e, a, b, alpha, beta = law
    n = np.repeat(np.logspace(7.5, 9.5, 5), 4)
    d = n * np.tile([5.0, 10.0, 20.0, 40.0], 5)
    loss = (e + a / n**alpha + b / d**beta) * np.exp(rng.normal(0, sigma, len(n)))
    return n, d, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--noise", type=float, default=0.01, help="log-normal sigma")
    parser.add_argument("--level", type=float, default=0.9)
    parser.add_argument("--resamples", type=int, default=300)
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"{args.trials} ladders per law, noise {args.noise}, {args.level:.0%} intervals, "
          f"{args.resamples} resamples")
    print(f"{'law':<10} {'scheme':<10} {'alpha':>6} {'beta':>6} {'E':>6}   fit rms error "
          "(alpha, beta)")
    for name, law in LAWS.items():
        rng = np.random.default_rng(123)
        hits = {s: np.zeros(3) for s in bootstrap.SCHEMES}
        errors = []
        truth = {"alpha": law[3], "beta": law[4], "E": law[0]}
        for t in range(args.trials):
            n, d, loss = ladder(law, args.noise, rng)
            fitted = laws.fit("chinchilla", n, loss, d)
            errors.append((fitted.alpha - law[3], fitted.beta - law[4]))
            for scheme in bootstrap.SCHEMES:
                bands = bootstrap.draw(fitted, n, loss, d, n=args.resamples, seed=t,
                                       level=args.level, scheme=scheme).param_intervals()
                hits[scheme] += [bands[k][0] <= v <= bands[k][1] for k, v in truth.items()]
        rms = np.sqrt(np.mean(np.square(errors), axis=0))
        for scheme, h in hits.items():
            rate = h / args.trials
            print(f"{name:<10} {scheme:<10} {rate[0]:>6.2f} {rate[1]:>6.2f} {rate[2]:>6.2f}   "
                  f"{rms[0]:.3f}, {rms[1]:.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
