"""What the loss layout changes (optim.loss_layout), measured on simulated batches of the official shape.

Not a speed measurement: a fidelity one. For batches like the official run's (64 prompts x 8 responses,
one mini-batch, prompts of --prompt tokens, responses of --response tokens, 8192-token micro-batches)
it compares, token by token:
- the gradient weight of each token (the factor its loss term gets): the official layout (verl 0.7's
  legacy worker on 16 ranks: 1 / (ranks x the micro-batch's tokens) x the micro-batch's row share)
  over the global token-mean's 1 / (the mini-batch's tokens) (verl 0.9.1 on any hardware, and
  `loss_layout: global`);
- STARE's selection (L+, top 10% of positive-advantage tokens by surprisal, per loss call): the share
  of the official layout's selected tokens that another layout also selects: the global layout on one
  process (the embedded backend), and the official rule on 8 ranks (one node of 8 GPUs) instead of 16.
Surprisals are drawn i.i.d. per token (exponential, mean 1), advantages +-1 per response at random:
the point is which tokens compete, not their values.

    python benchmarks/perf/loss_layouts.py [--batches 10 --response 200:3072 --prompt 100:1024]
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from baselines.micro_batches import official_loss_calls, token_budget_micro_batches


def _selected(calls: list[list[int]], resp: list[int], adv: list[float], surprisal: list[np.ndarray],
              P: float = 0.1) -> set[tuple[int, int]]:
    """(row, position) of every L+ token when each call selects over its own rows."""
    out = set()
    for rows in calls:
        cand = [(r, surprisal[r]) for r in rows if adv[r] > 0]
        if not cand:
            continue
        vals = np.concatenate([s for _, s in cand])
        n = len(vals)
        k = min(n, max(1, int(n * P + 0.999999)))
        top = np.argpartition(-vals, k - 1)[:k]
        starts = np.cumsum([0] + [len(s) for _, s in cand])
        owner = np.searchsorted(starts, top, side="right") - 1
        for t, o in zip(top.tolist(), owner.tolist()):
            out.add((cand[o][0], t - int(starts[o])))
    return out


def simulate(rng: random.Random, nrng: np.random.Generator, prompt: tuple[int, int], response: tuple[int, int],
             budget: int, B: int = 512) -> dict:
    plen = [rng.randint(*prompt) for _ in range(B)]
    resp = [rng.randint(*response) for _ in range(B)]
    lengths = [p + r for p, r in zip(plen, resp)]
    adv = [rng.choice([-1.0, 1.0]) for _ in range(B)]
    surprisal = [nrng.exponential(1.0, r) for r in resp]
    (official,) = official_loss_calls(lengths, B, 16, budget)
    (one_node,) = official_loss_calls(lengths, B, 8, budget)
    glob = token_budget_micro_batches(lengths, budget)  # one process, verl 0.9.1's rule
    # gradient weight per token, official over global: the same for every token of a call
    total = sum(resp)
    ratios = np.concatenate([np.full(sum(resp[r] for r in c.rows), c.scale / sum(resp[r] for r in c.rows) * total)
                             for c in official])
    s_off = _selected([c.rows for c in official], resp, adv, surprisal)
    s_glob = _selected(glob, resp, adv, surprisal)
    s_node = _selected([c.rows for c in one_node], resp, adv, surprisal)
    over = [sum(lengths[r] for r in c.rows) > budget for c in official]
    return {"ratios": ratios, "vs_global": len(s_off & s_glob) / len(s_off),
            "vs_one_node": len(s_off & s_node) / len(s_off), "calls_official": len(official),
            "calls_global": len(glob), "over_budget": sum(over) / len(over)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--prompt", default="100:1024", help="prompt tokens, uniform lo:hi")
    ap.add_argument("--response", action="append", help="response tokens, uniform lo:hi (repeatable)")
    ap.add_argument("--tokens", type=int, default=8192, help="micro-batch token budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prompt = tuple(int(x) for x in args.prompt.split(":"))
    for spec in args.response or ["200:1500", "200:3072", "2500:3072"]:
        response = tuple(int(x) for x in spec.split(":"))
        rng, nrng = random.Random(args.seed), np.random.default_rng(args.seed)
        runs = [simulate(rng, nrng, prompt, response, args.tokens) for _ in range(args.batches)]
        ratios = np.concatenate([r["ratios"] for r in runs])
        q = np.percentile(ratios, [0, 5, 50, 95, 100])
        mean = lambda k: float(np.mean([r[k] for r in runs]))  # noqa: E731
        lo, hi = min(r["vs_global"] for r in runs), max(r["vs_global"] for r in runs)
        print(f"responses {response[0]}-{response[1]} tokens, prompts {prompt[0]}-{prompt[1]}, "
              f"{args.batches} batches of 512 rows, budget {args.tokens}:")
        print(f"  loss calls per mini-batch: official {mean('calls_official'):.1f} (16 ranks), "
              f"global {mean('calls_global'):.1f} (one process); official calls over the budget: "
              f"{100 * mean('over_budget'):.1f}%")
        print(f"  token gradient weight, official / global: min {q[0]:.2f}, 5th {q[1]:.2f}, median {q[2]:.2f}, "
              f"95th {q[3]:.2f}, max {q[4]:.2f}")
        print(f"  official L+ also selected by: global one-process {100 * mean('vs_global'):.1f}% "
              f"({100 * lo:.1f}-{100 * hi:.1f}), official rule on 8 ranks {100 * mean('vs_one_node'):.1f}%")


if __name__ == "__main__":
    main()
