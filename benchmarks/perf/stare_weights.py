"""Cost of STARE's selection, measured side by side in one run (candidates alternate, medians).

Two scopes:
- batch: STARE weights over a whole training batch (B x T) vs the vanilla PPO-clip loss forward and vs
  the official approach (boolean indexing + torch.topk per subset, host reads for the sizes);
- official: the selection inside one loss call, on micro-batches of at most --tokens tokens (rows of a
  rollout batch partitioned as verl's dynamic batch size does): the method layer's per-loss-call
  selection, as it runs (weights, then the selected shares read as numbers, as the trainer logs them),
  vs a faithful reimplementation of the official function as it runs (its metrics included,
  benchmarks/perf/official_reference.py), and vs the PPO-clip loss forward of the same micro-batch.

    python benchmarks/perf/stare_weights.py [--scope both --B 512 --T 4096 --tokens 8192 --device cpu]
        [--threads 1 --clock thread]   # CPU time of this thread: steady while other processes share the cores

Targets: batch scope, ours <= 0.8x the PPO-clip forward and >= 1.7x faster than the official approach;
official scope, ours >= 1.7x faster than the official function and <= 0.3x the PPO-clip forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from baselines.losses import ppo_clip_loss
from baselines.micro_batches import token_budget_micro_batches
from baselines.stare import stare_token_weights
from benchmarks.perf.official_reference import official_weights


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def race(cands: dict, device: str, repeats: int, clock: str = "wall") -> dict[str, float]:
    """Median seconds per candidate, the candidates alternating within every repeat. clock 'thread'
    counts this thread's CPU time only (one torch thread, on the CPU): what other processes take
    from the cores does not count, their effect on caches does."""
    now = CLOCKS[clock]
    for fn in cands.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(repeats):
        for name, fn in cands.items():
            sync(device)
            t0 = now()
            fn()
            sync(device)
            times[name].append(now() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def batch_scope(args) -> None:
    d, B, T = args.device, args.B, args.T
    torch.manual_seed(0)
    old = (-torch.rand(B, T) * 5).to(d)
    new = old + 0.1 * torch.randn(B, T, device=d)
    adv = torch.randn(B, 1, device=d).expand(B, T).contiguous()
    lengths = (torch.rand(B, device=d) * 2 * args.valid * T).clamp(max=T).long()
    mask = (torch.arange(T, device=d)[None] < lengths[:, None]).float()
    v = args.variant
    med = race({
        "vanilla PPO-clip forward": lambda: ppo_clip_loss(new, old, adv, mask),
        "STARE weights (ours)": lambda: stare_token_weights(adv, old, mask, variant=v),
        "STARE weights (official approach)": lambda: official_weights(old, adv, mask, variant=v, with_metrics=False),
    }, d, args.repeats, args.clock)
    agree = (stare_token_weights(adv, old, mask, variant=v) == official_weights(old, adv, mask, variant=v,
                                                                                 with_metrics=False)[0]).float().mean()
    print(f"[batch scope] B x T = {B} x {T}, valid {mask.mean().item():.2f}, {v}, device {d}, "
          f"torch threads {torch.get_num_threads()}, repeats {args.repeats}, clock {args.clock}")
    for k, t in med.items():
        print(f"  {k:40s} {t * 1e3:9.2f} ms (median)")
    base, ours, off = med["vanilla PPO-clip forward"], med["STARE weights (ours)"], med["STARE weights (official approach)"]
    print(f"  ratio ours / PPO-clip forward   = {ours / base:.2f}  (target <= 0.8)")
    print(f"  speed-up ours vs official       = {off / ours:.2f}x (target >= 1.7)")
    print(f"  weights agreement               = {agree.item():.6f}")


def official_scope(args) -> None:
    from stare_cli.method.layer import MethodLayer, StareState
    from stare_cli.core.resolve import load_recipe

    d = args.device
    g = torch.Generator().manual_seed(0)
    # A rollout batch like the paper's: 64 prompts x 8 responses, prompts 100-1024 tokens, responses
    # 200-3072 tokens; one GRPO advantage per response.
    B = 512
    plen = torch.randint(100, 1025, (B,), generator=g)
    rlen = torch.randint(200, 3073, (B,), generator=g)
    parts = token_budget_micro_batches((plen + rlen).tolist(), args.tokens)
    layer = MethodLayer.from_recipe(load_recipe("short-cot/qwen2.5-math-7b", f"stare-{args.variant}"))
    state = StareState(True, layer.cfg.stare.W, layer.cfg.stare.M)
    micro = []
    for idx in parts:
        T = int(rlen[idx].max())
        mask = (torch.arange(T)[None] < rlen[idx][:, None]).float().to(d)
        lp = (-torch.rand(len(idx), T, generator=g) * 5).to(d) * mask
        old = lp + 0.01 * torch.randn(len(idx), T, generator=g).to(d) * mask
        adv = (torch.randn(len(idx), 1, generator=g).to(d) * mask).contiguous()
        micro.append((lp, old, adv, mask))
    P, W, M = layer.cfg.stare.P, state.W, state.M
    var = args.variant.upper()

    def ours():
        for lp, _, adv, mask in micro:
            _, stats = layer._stare(adv, lp, mask, state)  # what the layer's loss call runs
            [float(x) for x in stats.values()]  # the trainer logs the shares as numbers

    def official():
        for lp, _, adv, mask in micro:
            official_weights(lp, adv, mask, P=P, W=W, M=M, variant=var, gate=True)

    def vanilla():
        for lp, old, adv, mask in micro:
            ppo_clip_loss(lp, old, adv, mask)

    med = race({"PPO-clip loss forward": vanilla, "selection (ours, per loss call)": ours,
                "selection (official function, as it runs)": official}, d, args.repeats, args.clock)
    n_tok = sum(int(m.sum()) for *_, m in micro)
    print(f"[official scope] {len(micro)} micro-batches of <= {args.tokens} tokens ({n_tok} response tokens), "
          f"{args.variant}, device {d}, torch threads {torch.get_num_threads()}, repeats {args.repeats}, clock {args.clock}")
    for k, t in med.items():
        print(f"  {k:44s} {t * 1e3:9.2f} ms per mini-batch (median)")
    base, o, off = med["PPO-clip loss forward"], med["selection (ours, per loss call)"], \
        med["selection (official function, as it runs)"]
    print(f"  speed-up ours vs official       = {off / o:.2f}x (target >= 1.7)")
    print(f"  ratio ours / PPO-clip forward   = {o / base:.2f}  (target <= 0.3)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scope", default="both", choices=["both", "batch", "official"])
    ap.add_argument("--B", type=int, default=512, help="batch scope: responses")
    ap.add_argument("--T", type=int, default=4096, help="batch scope: response length")
    ap.add_argument("--valid", type=float, default=0.6, help="batch scope: mean share of valid tokens")
    ap.add_argument("--tokens", type=int, default=8192, help="official scope: micro-batch token budget")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", default="o1", choices=["o1", "c2"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--host-path", default="default", choices=["default", "numpy"],
                    help="numpy: the NumPy host selection even where the C one was built (to compare the two)")
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="wall: elapsed time; thread: this thread's CPU time (needs --threads 1 on the CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import baselines.stare as stare_mod

    if args.host_path == "numpy":
        stare_mod._kernel = None
    print(f"host selection: {'C (baselines/_stare_select.c)' if stare_mod._kernel is not None else 'NumPy'}")
    if args.clock == "thread" and (args.device != "cpu" or torch.get_num_threads() != 1):
        ap.error("--clock thread counts one thread's CPU time: use it with --device cpu --threads 1")
    if args.scope in ("both", "batch"):
        batch_scope(args)
    if args.scope in ("both", "official"):
        official_scope(args)


if __name__ == "__main__":
    main()
