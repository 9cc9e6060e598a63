"""How often a draft model's sampled draft is accepted: the Gumbel coupling the engine uses (the
draft drawn with the target sampler's noise, accepted where the two draws agree) against the
standard rejection rule's optimum, sum(min(p, q)) = 1 - TV(p, q), on synthetic distributions:
p = softmax(z / T) over a vocabulary of random logits z, q the same with z perturbed by sigma * N(0, 1)
(a draft model sigma away from the target). CPU, seconds.

    python benchmarks/speculative_coupling.py [--vocab 2000] [--trials 20] [--draws 4000]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=20, help="random (p, q) pairs per row")
    ap.add_argument("--draws", type=int, default=4000, help="shared-noise draws per pair")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| sigma | temperature | rejection rule (1 - TV) | Gumbel coupling | ratio |\n|---:|---:|---:|---:|---:|")
    for sigma in (0.3, 1.0, 2.0):
        for temperature in (0.7, 1.0):
            optimal, coupled = 0.0, 0.0
            for _ in range(args.trials):
                z = torch.randn(args.vocab, generator=g) * 3
                p = torch.softmax(z / temperature, dim=0)
                q = torch.softmax((z + sigma * torch.randn(args.vocab, generator=g)) / temperature, dim=0)
                optimal += float(torch.minimum(p, q).sum()) / args.trials
                noise = -torch.log(torch.rand(args.draws, args.vocab, generator=g))  # the exponential race of engine/sampler.draw
                coupled += float(((p / noise).argmax(1) == (q / noise).argmax(1)).float().mean()) / args.trials
            print(f"| {sigma} | {temperature} | {optimal:.3f} | {coupled:.3f} | {coupled / optimal:.2f} |")


if __name__ == "__main__":
    main()
