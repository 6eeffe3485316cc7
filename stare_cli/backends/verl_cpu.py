"""verl 0.9.x on CPU: run verl's real trainer (main_ppo, V1 trainer, FSDP2 engine, agent-loop rollout,
reward loop, TransferQueue) on a machine without GPUs, to debug a recipe on a laptop and to test the
verl backend end to end in CI. Selected by `backend.verl.device: cpu` (`stare train --device cpu`).

verl 0.9.1 as shipped cannot run on CPU. This module is imported in every verl process (through
VERL_USE_EXTERNAL_MODULES, at `import verl`) and adds, without editing verl:
- a CPU platform (`VERL_PLATFORM=stare_cpu`): device "cpu", gloo collectives, no-op memory calls.
  It reports its accelerator to Ray as "GPU", because verl's resource-pool check counts Ray "GPU"
  resources by name; `cpu_overrides` starts Ray with one such slot per trainer process;
- verl's FSDP/FSDP2 engines registered for device "cpu" (verl registers them for cuda/npu only);
- an `hf` rollout (verl 0.9.1 ships only vllm/sglang/trtllm servers): a Ray actor that serves verl's
  token-in/token-out `generate` with HF transformers, batching concurrent requests, and receives the
  actor's weights through verl's own hybrid `update_weights` path before every rollout.

What this path does NOT exercise: vLLM (sampling kernels, sleep/wake, CUDA IPC weight sync), NCCL,
FSDP sharding across several GPUs, flash-attention / remove-padding, bf16 kernels. The trainer's
control flow, data path, advantage/loss code, our driver extension (STARE), checkpoints and metrics
are verl's own and run unchanged.
"""

from __future__ import annotations

import asyncio
import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

PLATFORM = "stare_cpu"
MODULE = "stare_cli.backends.verl_cpu"


def cpu_overrides(n_procs: int = 1, job: bool = False) -> dict[str, object]:
    """Hydra overrides that make verl's config runnable on CPU; they replace the recipe's values for
    the same keys (a leading `+` adds a key verl's schema does not declare). `job`: for a running Ray
    cluster (`ray job submit`), started with the same resources: `ray start --head --num-gpus 1 --num-cpus 16`."""
    ray = {} if job else {
        "+ray_kwargs.ray_init.num_gpus": n_procs,  # our platform's Ray "GPU" slots (module docstring)
        "+ray_kwargs.ray_init.num_cpus": 16,  # TransferQueue and the agent/reward loops each reserve CPUs
    }
    return {
        "trainer.n_gpus_per_node": n_procs,
        "trainer.nnodes": 1,
        "trainer.device": "cpu",
        **ray,
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 2,
        "actor_rollout_ref.rollout.name": "hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.model.use_remove_padding": False,  # needs flash-attn's varlen kernels
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "actor_rollout_ref.ref.strategy": "fsdp2",
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32",
        "actor_rollout_ref.actor.fsdp_config.param_offload": False,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
        "actor_rollout_ref.actor.use_torch_compile": False,
        "actor_rollout_ref.ref.use_torch_compile": False,
        "data.dataloader_num_workers": 0,
        "reward.num_workers": 1,
    }


def environment() -> dict[str, str]:
    return {"VERL_PLATFORM": PLATFORM, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "TOKENIZERS_PARALLELISM": "false"}


# ----------------------------------------------------------------------------------------- platform

def _device_module() -> types.ModuleType:
    """torch.cpu plus the torch.cuda calls verl makes on its device module, as no-ops where CPU has
    nothing to do (caches, peak-memory stats)."""
    import psutil

    m = types.ModuleType("stare_cpu_device")
    m.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})

    def mem_get_info(device=None):
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    zero = lambda *a, **k: 0  # noqa: E731
    none = lambda *a, **k: None  # noqa: E731
    m.__dict__.update(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: "cpu", set_device=none,
        synchronize=none, empty_cache=none, ipc_collect=none, reset_peak_memory_stats=none,
        memory_allocated=zero, memory_reserved=zero, max_memory_allocated=zero, max_memory_reserved=zero,
        mem_get_info=mem_get_info, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *a, **k: torch.get_rng_state(), set_rng_state=lambda s, *a, **k: torch.set_rng_state(s),
        get_device_name=lambda *a, **k: "cpu", get_device_capability=lambda *a, **k: (None, None),
        is_bf16_supported=lambda *a, **k: True, memory_stats=lambda *a, **k: {},
    )
    return m


def _platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformStareCPU(PlatformBase):
        """verl's platform interface on CPU (see the module docstring for the Ray "GPU" slot)."""

        _module = None

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            if PlatformStareCPU._module is None:
                PlatformStareCPU._module = _device_module()
            return PlatformStareCPU._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return False  # never auto-detected: chosen only through VERL_PLATFORM

        def current_device(self):
            return "cpu"  # verl passes this to .to(...) and device=...; an int would mean an accelerator

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformStareCPU


# ------------------------------------------------------------------------------------------ rollout

def _sample_batch(model, prompts: list[list[int]], params: dict, max_tokens: int, eos_ids: list[int],
                  pad_id: int) -> list[tuple[list[int], list[float], str]]:
    """Sample continuations of token-id prompts (left-padded batch, KV cache) with HF generate.

    Returns per prompt (token ids, log-probs of the sampling distribution, stop reason)."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    temperature = float(params.get("temperature", 1.0))
    greedy = temperature <= 0
    top_k = int(params.get("top_k", -1) or -1)
    gen = GenerationConfig(
        do_sample=not greedy, temperature=None if greedy else temperature,
        top_p=None if greedy else float(params.get("top_p", 1.0)), top_k=top_k if (top_k > 0 and not greedy) else None,
        max_new_tokens=max_tokens, eos_token_id=eos_ids, pad_token_id=pad_id,
        repetition_penalty=float(params.get("repetition_penalty", 1.0)),
        output_scores=True, return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen)
    seqs = out.sequences[:, width:]
    if out.scores:
        lp = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1)
        lp = torch.where(torch.isneginf(lp), torch.full_like(lp, -1e4), lp)
    else:
        lp = torch.zeros(seqs.shape)
    results = []
    for toks, lps in zip(seqs.tolist(), lp.tolist()):  # whole rows to Python: no per-token tensor access
        stop = next((t for t, tok in enumerate(toks) if tok in eos_ids), None)
        n = len(toks) if stop is None else stop + 1
        results.append((toks[:n], lps[:n], "length" if stop is None else "completed"))
    return results


class HFServer:
    """verl's rollout-server interface (token-in/token-out `generate`, sleep/wake, abort) served by
    HF transformers on CPU. Concurrent requests with equal sampling parameters are batched."""

    def __init__(self, model_path: str, response_length: int, prompt_length: int, seed: int = 0,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          trust_remote_code=trust_remote_code).eval()
        from benchmarks.generation.attention import use_gqa_sdpa_on_cpu

        use_gqa_sdpa_on_cpu(self.model)
        gc = GenerationConfig.from_model_config(self.model.config)
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.response_length, self.prompt_length = response_length, prompt_length
        self.pending: list[tuple[list[int], dict, int, asyncio.Future]] = []
        self.worker: Optional[asyncio.Task] = None
        self.global_steps: Optional[int] = None  # the weights' version; verl logs trajectory staleness

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: Optional[int]) -> int:
        """The actor's weights (HF names) before a rollout; returns the number of tensors loaded."""
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown:
            raise KeyError(f"hf rollout: weights the model does not have: {unknown[:5]}")
        self.model.load_state_dict(state, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.global_steps = global_steps
        return len(state)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        max_tokens = max(1, int(max_tokens))
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), params, max_tokens, fut))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._drain())
        toks, lps, reason = await fut
        return TokenOutput(token_ids=toks, log_probs=lps if params.get("logprobs") else None, stop_reason=reason,
                           extra_fields={"global_steps": self.global_steps})

    async def _drain(self):
        while self.pending:
            await asyncio.sleep(0.02)  # let the agent loop's concurrent requests arrive
            key = lambda p: (repr(sorted((k, v) for k, v in p[1].items() if k != "logprobs")), p[2])  # noqa: E731
            first = key(self.pending[0])
            batch = [p for p in self.pending if key(p) == first][:256]
            self.pending = [p for p in self.pending if not any(p is b for b in batch)]
            try:
                res = await asyncio.to_thread(_sample_batch, self.model, [b[0] for b in batch], batch[0][1], batch[0][2],
                                              self.eos_ids, self.pad_id)
                for b, r in zip(batch, res):
                    b[3].set_result(r)
            except Exception as e:  # surface in every waiting request
                for b in batch:
                    if not b[3].done():
                        b[3].set_exception(e)

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def wait_for_requests_to_drain(self):
        while self.pending:
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, *a, **k) -> dict:
        return {"aborted": 0}


async def _nothing_to_do(self, *args, **kwargs) -> None:
    return None


# verl's server control calls that have nothing to free or resume on CPU
for _name in ("wake_up", "sleep", "clear_kv_cache", "release_kv_cache", "resume_kv_cache", "start_profile",
              "stop_profile", "resume_generation"):
    setattr(HFServer, _name, _nothing_to_do)


def server_name(replica_rank: int) -> str:
    return f"stare_hf_rollout_server_{replica_rank}"


def _replica_class():
    import ray

    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One HF rollout server per replica; hybrid mode only (weights come from the fused workers)."""

        async def launch_servers(self):
            cfg = self.config
            server = ray.remote(HFServer).options(
                name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency,
            ).remote(self.model_config.local_path if hasattr(self.model_config, "local_path") else self.model_config.path,
                     cfg.response_length, cfg.prompt_length, seed=int(getattr(cfg, "seed", 0) or 0),
                     trust_remote_code=bool(getattr(self.model_config, "trust_remote_code", False)))
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"hf-rollout-{self.replica_rank}"

        async def abort_all_requests(self, reject_request: bool = False):
            return {"aborted": 0}

        async def abort_request(self, request_id: str):
            return {"aborted": False}

    return HFReplica


def _adapter_class():
    import ray

    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """The fused worker's side of the `hf` rollout: pushes the actor's weights to the server."""

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size * \
                self.config.pipeline_model_parallel_size
            self.replica_rank, self.is_leader = rank // tp, rank % tp == 0

        async def resume(self, tags: list[str]):
            pass

        async def release(self):
            pass

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise NotImplementedError(f"hf rollout: wire format {wire_format}")
            state = {}
            for name, tensor in weights:
                if hasattr(tensor, "full_tensor"):  # a DTensor shard from FSDP2
                    tensor = tensor.full_tensor()
                state[name] = tensor.detach().to("cpu", torch.float32).clone()
            if self.is_leader:
                server = ray.get_actor(server_name(self.replica_rank))
                await server.load_weights.remote(state, kwargs.get("global_steps"))

    return HFServerAdapter


def _patch_process_group() -> None:
    """verl asks for "cpu:gloo,<device>:<collective>", i.e. "cpu:gloo,cpu:gloo" here, which torch rejects."""
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_stare_cpu", False):
        return
    orig = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend:
            kwargs["backend"] = "gloo"
        return orig(*args, **kwargs)

    init_process_group._stare_cpu = True
    dist.init_process_group = init_process_group


_installed = False
HFServerAdapter = None  # set by install(); verl's rollout registry imports it by this module path


def install() -> None:
    """Register the CPU platform, the engines for device cpu and the `hf` rollout with verl."""
    global HFServerAdapter, _installed
    # Importing verl runs verl's __init__, which imports the external modules (ours among them) and
    # may call install() again from there: the inner call completes it, this one then returns.
    from verl.plugin.platform import PlatformRegistry

    if _installed:
        return
    _patch_process_group()

    if PlatformRegistry.get(PLATFORM) is None:
        PlatformRegistry.register(PLATFORM)(_platform_class())
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithValueHead)
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    if HFServerAdapter is None:
        HFServerAdapter = _adapter_class()
    rollout_base._ROLLOUT_REGISTRY[("hf", "async")] = f"{MODULE}.HFServerAdapter"
    replica = _replica_class()
    RolloutReplicaRegistry.register("hf", lambda: replica)
    _installed = True


if os.environ.get("VERL_PLATFORM") == PLATFORM:
    install()
