"""The embedded trainer's training forward: token log-probs and entropies of packed rollout rows.

Each row is prompt + response from position 0, right-padded (`pack`), so causal attention needs no
padding mask; rows go through the model in length-sorted buckets, each padded only to its own
longest row (`length_buckets`); on the CPU the responses of a prompt can share one forward of that
prompt (its key/value cache). Every layout gives the values of a per-row forward up to float
rounding (tests/test_forward.py), reassembled in batch order.
"""

from __future__ import annotations

import math
from typing import Optional

from stare_kernel.errors import StareError

# The fixed cost of one more forward/backward in `length_buckets`, in padded-token equivalents.
# Measured on the CPU toy (one thread): see benchmarks/perf/length_buckets.py.
BUCKET_OVERHEAD_TOKENS = 128


def length_buckets(lengths: list[int], overhead_tokens: Optional[int] = None) -> list[list[int]]:
    """Split rows into buckets of similar length, each to be padded only to its own longest row.

    lengths: [B] tokens per row. Sorted by length, contiguous runs are chosen by dynamic programming
    to minimise padded tokens (rows x longest row, summed over buckets) plus `overhead_tokens` per
    bucket, the fixed cost of one more forward/backward. Returns row indices per bucket, shortest first.
    """
    if overhead_tokens is None:
        overhead_tokens = BUCKET_OVERHEAD_TOKENS
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    ls = [lengths[i] for i in order]
    n = len(ls)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: cheapest split of the j shortest rows
        for i in range(j):
            c = best[i] + (j - i) * ls[j - 1] + overhead_tokens
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def token_logprobs_entropy(model, batch: dict, rows, temperature: float, need_entropy: bool = True,
                           buckets: bool = True, share_prompts: bool = False, chunked_head: Optional[bool] = None):
    """log pi(o_t) and entropy H_t at the response positions of batch rows `rows`: [len(rows), T]
    each (T = the batch's longest response), 0 past a row's response.

    batch: from `pack` (each row prompt + response from position 0, right-padded). With `buckets`
    the rows go through the model in length-sorted buckets (`length_buckets`), each cut to its own
    longest row; otherwise in one forward. Either way no attention mask is needed: right padding only
    follows the real tokens, which causal attention never lets them see. Logits are divided by the
    sampling temperature, as the rollout distribution (verl does too).

    With `share_prompts`, rows whose prompt is the same (a GRPO group's n responses) share one
    forward of that prompt: `_shared_prompt_logprobs_entropy`. Same numbers up to float rounding,
    fewer tokens through the model.

    With `chunked_head` (default: wherever `lm_head.supports(model)`), the LM head runs only on the
    positions that predict response tokens, in chunks straight from the last hidden state
    (`lm_head.head_logprob_entropy`): no [positions x vocabulary] tensor for the whole micro-batch,
    forward or backward. Otherwise the model's logits, as transformers computes them.
    """
    from stare_cli.backends import lm_head

    rows = [int(r) for r in rows]
    head = _Head.of(model) if (chunked_head is None and lm_head.supports(model)) or chunked_head else None
    if share_prompts and len(set(batch["prompt_group"][rows].tolist())) < len(rows):
        return _shared_prompt_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets, head)
    return _row_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets, head)


class _Head:
    """The decoder and the output embedding of a model whose logits are lm_head(last hidden state)."""

    def __init__(self, decoder, weight, bias) -> None:
        self.decoder, self.weight, self.bias = decoder, weight, bias

    @classmethod
    def of(cls, model) -> "_Head":
        out = model.get_output_embeddings()
        return cls(model.model, out.weight, out.bias)

    def scores(self, hidden, rows, cols, targets, temperature: float, need_entropy: bool, shape):
        """log pi and H [b, T] (0 elsewhere) for the positions (rows[n], cols[n]) of the output, whose
        hidden states are hidden [N, d] and whose tokens are targets [N]."""
        import torch

        from stare_cli.backends.lm_head import head_logprob_entropy

        lp, H = head_logprob_entropy(hidden, self.weight, self.bias, targets, temperature, need_entropy)
        zeros = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
        return zeros.index_put((rows, cols), lp), (zeros.index_put((rows, cols), H) if need_entropy else None)


def _response_positions(rlens: list[int], device):
    """(bucket row k, response token j) of every response token of a bucket, as two [N] device tensors:
    k repeated rlens[k] times, and 0 .. rlens[k] - 1 for each."""
    import torch

    ks = [k for k, n in enumerate(rlens) for _ in range(n)]
    js = [j for n in rlens for j in range(n)]
    return torch.tensor([ks, js], dtype=torch.long, device=device).unbind(0)


def _inverse(pos: list[int]) -> list[int]:
    """The inverse permutation: where each original index sits in `pos` (bucket order)."""
    inv = [0] * len(pos)
    for k, i in enumerate(pos):
        inv[i] = k
    return inv


def _row_logprobs_entropy(model, batch: dict, rows: list[int], temperature: float, need_entropy: bool,
                          buckets: bool, head: Optional[_Head] = None):
    """`token_logprobs_entropy` with each row's prompt and response in one sequence."""
    import torch

    ids_all = batch["input_ids"]
    plens, slens = batch["prompt_len"].tolist(), batch["seq_len"].tolist()  # host tensors: no device sync
    T = batch["response_mask"].shape[1]
    lens = [slens[r] for r in rows]
    groups = length_buckets(lens) if buckets else [list(range(len(rows)))]
    pos = [i for g in groups for i in g]  # positions in `rows`, bucket by bucket
    order = [rows[i] for i in pos]
    inv = _inverse(pos)
    # One host-to-device copy: batch rows in bucket order, their prompt and response lengths, and
    # where each of `rows` lands in that order (every copy waits for the GPU's queue).
    idx_all, p_all, rlen_all, inv_t = torch.tensor(
        [order, [plens[r] for r in order], [slens[r] - plens[r] for r in order], inv], device=ids_all.device)
    j = torch.arange(T, device=ids_all.device)
    lps, ents = [], []
    start = 0
    for g in groups:
        sl = slice(start, start + len(g))
        start += len(g)
        L, p0 = max(slens[r] for r in order[sl]), min(plens[r] for r in order[sl])
        if L == p0:  # only empty responses: nothing to score
            lps.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            ents.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            continue
        ids, p = ids_all[idx_all[sl], :L], p_all[sl]
        if head is not None:  # the LM head on response positions only, in chunks
            rl = [slens[r] - plens[r] for r in order[sl]]
            k, jj = _response_positions(rl, ids.device)
            at = p[k] + jj  # packed column of response token j; the hidden state one before predicts it
            hidden = head.decoder(input_ids=ids).last_hidden_state
            lp, en = head.scores(hidden[k, at - 1], k, jj, ids[k, at], temperature, need_entropy, (len(g), T))
            lps.append(lp)
            if need_entropy:
                ents.append(en)
            continue
        # Logits only where they predict response tokens: positions p0-1 .. L-2 predict tokens p0 .. L-1.
        logits = model(input_ids=ids, logits_to_keep=L - p0 + 1).logits[:, :-1].float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        lp_pos = logp_all.gather(-1, ids[:, p0:].unsqueeze(-1)).squeeze(-1)  # [b, L - p0]
        col = ((p - p0)[:, None] + j[None]).clamp(max=L - p0 - 1)  # response token j of a row sits at p + j
        valid = (j[None] < rlen_all[sl, None]).float()
        lps.append(lp_pos.gather(1, col) * valid)
        if need_entropy:
            ent_pos = -(logp_all.exp() * logp_all).sum(-1)
            ents.append(ent_pos.gather(1, col) * valid)
    return torch.cat(lps)[inv_t], (torch.cat(ents)[inv_t] if need_entropy else None)


def _shared_prompt_logprobs_entropy(model, batch: dict, rows: list[int], temperature: float, need_entropy: bool,
                                    buckets: bool, head: Optional[_Head] = None):
    """`token_logprobs_entropy` with each distinct prompt through the model once.

    1. The distinct prompts of `rows`, left-padded to the longest (P tokens, positions from 0 at each
       prompt's first token), in one forward that keeps its key/value cache and the logits of the last
       prompt token (they predict response token 0).
    2. The responses, in buckets by response length (`length_buckets`): each row's prompt cache is
       selected (autograd adds the gradients of a group's rows into its prompt), and response tokens
       0 .. R-2 run on top of it with their own positions; their logits predict tokens 1 .. R-1. A
       row's last token predicts nothing and is not run.
    On the toy (16 prompts x 8 responses, prompts a quarter of a row) a training step's forward and
    backward cost 18% less (benchmarks/perf/trainer_vs_trl.py). Needs a model whose cache is
    transformers' per-layer key/value `DynamicCache`; otherwise the row path runs.
    """
    import torch
    from transformers import DynamicCache

    ids_all = batch["input_ids"]
    dev = ids_all.device
    plens, slens = batch["prompt_len"].tolist(), batch["seq_len"].tolist()
    group_of = batch["prompt_group"].tolist()
    T = batch["response_mask"].shape[1]
    first_row: dict[int, int] = {}  # prompt group -> its first row among `rows`
    for r in rows:
        first_row.setdefault(group_of[r], r)
    prefix_of = {g: k for k, g in enumerate(first_row)}
    reps = list(first_row.values())
    P = max(plens[r] for r in reps)
    # [U, P] left-padded prompts; column c of prompt u holds its token c - (P - p_u) (pad before 0).
    src_col = torch.tensor([[c - (P - plens[r]) for c in range(P)] for r in reps], device=dev)
    pmask = (src_col >= 0).long()
    pids = ids_all[torch.tensor(reps, device=dev)].gather(1, src_col.clamp(min=0)) * pmask
    cache = DynamicCache()
    kw = dict(input_ids=pids, attention_mask=pmask, position_ids=src_col.clamp(min=0), past_key_values=cache,
              use_cache=True)
    out = head.decoder(**kw) if head is not None else model(**kw, logits_to_keep=1)
    layers = getattr(out.past_key_values, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return _row_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets, head)
    prefix_kv = [(layer.keys, layer.values) for layer in layers]
    # each prompt's last position predicts its response token 0: its hidden state [U, d], or logits [U, V]
    first = out.last_hidden_state[:, -1] if head is not None else out.logits[:, -1]

    rlens = [slens[r] - plens[r] for r in rows]
    groups = length_buckets(rlens) if buckets else [list(range(len(rows)))]
    j = torch.arange(T, device=dev)
    lps, ents, pos = [], [], []
    for g in groups:
        pos += g
        R = max(rlens[i] for i in g)
        if R == 0:  # only empty responses: nothing to score
            lps.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            ents.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            continue
        brows = [rows[i] for i in g]
        src, row_t, p = torch.tensor([[prefix_of[group_of[r]] for r in brows], brows, [plens[r] for r in brows]],
                                     device=dev)
        # Response token k of a row sits at column p + k of its packed row (clamped: padding past the end).
        cols = (p[:, None] + j[None, :R]).clamp(max=ids_all.shape[1] - 1)
        resp = ids_all[row_t].gather(1, cols)  # [b, R]
        logits = first[src][:, None]  # [b, 1, V], or [b, 1, d] hidden states with the chunked head
        if R > 1:
            bucket_cache = DynamicCache()
            for li, (k, v) in enumerate(prefix_kv):
                bucket_cache.update(k[src], v[src], li)
            mask = torch.cat([pmask[src], pmask.new_ones(len(g), R - 1)], 1)
            kw = dict(input_ids=resp[:, :-1], attention_mask=mask, position_ids=p[:, None] + j[None, :R - 1],
                      past_key_values=bucket_cache, use_cache=True)
            more = head.decoder(**kw).last_hidden_state if head is not None else model(**kw).logits
            logits = torch.cat([logits, more], 1)
        if head is not None:  # the LM head on response positions only, in chunks
            k, jj = _response_positions([rlens[i] for i in g], dev)
            lp, en = head.scores(logits[k, jj], k, jj, resp[k, jj], temperature, need_entropy, (len(g), T))
            lps.append(lp)
            if need_entropy:
                ents.append(en)
            continue
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [b, R, V]
        valid = (j[None, :R] < torch.tensor([rlens[i] for i in g], device=dev)[:, None]).float()
        lps.append(torch.nn.functional.pad(logp_all.gather(-1, resp.unsqueeze(-1)).squeeze(-1) * valid, (0, T - R)))
        if need_entropy:
            ents.append(torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1) * valid, (0, T - R)))
    inv_t = torch.tensor(_inverse(pos), device=dev)
    return torch.cat(lps)[inv_t], (torch.cat(ents)[inv_t] if need_entropy else None)


def pack(samples: list, pad_id: int, device) -> dict:
    """Tensors for a list of rollout samples: each row is prompt + response from position 0, right-padded.

    input_ids [B, L]; prompt_len, seq_len, prompt_group [B] (host tensors; rows with the same prompt
    tokens share a prompt_group); response_mask [B, T] (T: the longest response; 0 on padding and on
    tool observations).
    """
    import torch

    plens = [len(s.prompt_ids) for s in samples]
    slens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    groups: dict[tuple, int] = {}
    if min(plens) < 1:
        raise StareError("a rollout sample has an empty prompt", hint="the first response token needs a prompt token before it")
    L, T = max(slens), max(1, max(len(s.response_ids) for s in samples))
    ids, rmask = [], []
    for s in samples:
        p, r = s.prompt_ids, s.response_ids
        ids.append(list(p) + list(r) + [pad_id] * (L - len(p) - len(r)))
        # Tool observations are context, not actions: mask 0 keeps them out of the loss, the
        # entropy and the STARE token sets.
        lm = s.loss_mask if s.loss_mask is not None else [1] * len(r)
        rmask.append(list(lm) + [0] * (T - len(r)))
    return {
        "input_ids": torch.tensor(ids, device=device),
        "prompt_len": torch.tensor(plens),  # on the host: bucketing reads them without a device sync
        "seq_len": torch.tensor(slens),
        "prompt_group": torch.tensor([groups.setdefault(tuple(s.prompt_ids), len(groups)) for s in samples]),
        "response_mask": torch.tensor(rmask, dtype=torch.float32, device=device),
    }
