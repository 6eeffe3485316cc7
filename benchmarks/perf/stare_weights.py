"""Cost of STARE's token weights beside the vanilla PPO-clip loss forward, and beside the official
approach (boolean indexing + torch.topk per subset with .item() calls, reimplemented here from its
description). Prints ratios measured side by side in one run, alternating the candidates.

    python benchmarks/perf/stare_weights.py [--B 512 --T 4096 --valid 0.6 --repeats 7 --device cpu]

Targets (issue: algorithm core): ours <= 0.8x vanilla PPO-clip forward; >= 1.7x faster than official.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from baselines.losses import ppo_clip_loss
from baselines.stare import stare_token_weights


def official_weights(adv, old_log_prob, mask, P=0.1, W=1.1, M=0.9, variant="o1"):
    """The official code's shape: per subset, boolean-index the surprisals, torch.topk, and map
    the top-k back to (row, column) through the subset's nonzero indices; .item() for sizes."""
    s = -old_log_prob
    w = torch.ones_like(adv)
    valid = mask.bool()
    subsets = [(valid & (adv > 0), W)] + ([(valid & (adv < 0), M)] if variant == "c2" else [])
    for members, weight in subsets:
        n = int(members.sum().item())
        if n == 0:
            continue
        k = max(1, math.ceil(P * n))
        _, top = torch.topk(s[members], k)
        rc = members.nonzero()[top]
        w[rc[:, 0], rc[:, 1]] = weight
    return w


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fn, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=512)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--valid", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", default="o1", choices=["o1", "c2"])
    args = ap.parse_args()
    torch.manual_seed(0)
    d = args.device
    B, T = args.B, args.T
    old = (-torch.rand(B, T) * 5).to(d)
    new = old + 0.1 * torch.randn(B, T, device=d)
    adv = torch.randn(B, 1, device=d).expand(B, T).contiguous()
    lengths = (torch.rand(B, device=d) * 2 * args.valid * T).clamp(max=T).long()
    mask = (torch.arange(T, device=d)[None] < lengths[:, None]).float()

    cands = {
        "vanilla PPO-clip forward": lambda: ppo_clip_loss(new, old, adv, mask),
        "STARE weights (ours)": lambda: stare_token_weights(adv, old, mask, variant=args.variant),
        "STARE weights (official approach)": lambda: official_weights(adv, old, mask, variant=args.variant),
    }
    # Same selection (official ties may select a few more at the threshold; compare counts).
    ours_w = stare_token_weights(adv, old, mask, variant=args.variant)
    off_w = official_weights(adv, old, mask, variant=args.variant)
    agree = (ours_w == off_w).float().mean().item()
    for fn in cands.values():  # warm-up
        fn()
    results = {name: [] for name in cands}
    for _ in range(args.repeats):  # alternate so drift on a shared machine hits all alike
        for name, fn in cands.items():
            results[name].extend(timeit(fn, d, 1)[1])
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"B x T = {B} x {T}, valid {mask.mean().item():.2f}, {args.variant}, device {d}, "
          f"torch threads {torch.get_num_threads()}, repeats {args.repeats}")
    for k, v in med.items():
        print(f"  {k:36s} {v * 1e3:8.1f} ms (median)")
    base = med["vanilla PPO-clip forward"]
    ours = med["STARE weights (ours)"]
    off = med["STARE weights (official approach)"]
    print(f"ratio ours / vanilla      = {ours / base:.2f}  (target <= 0.8)")
    print(f"ratio official / vanilla  = {off / base:.2f}")
    print(f"speed-up ours vs official = {off / ours:.2f}x (target >= 1.7)")
    print(f"weights agreement         = {agree:.6f}")


if __name__ == "__main__":
    main()
