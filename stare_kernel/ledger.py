"""The ledger: one immutable record per evaluation, carrying everything that makes it what it is.

A record is one benchmark evaluated once: one model's weights (for a training run: its recipe, method,
step and learning rate), one set of problems and golds, one protocol (samples, temperature, top_p,
max tokens, template, the rendered prompt format, tools), one grader@version, one engine@version and
dtype, and one seed. Its **identity** is all of that except the seed: records pool (as seeds of one
row, one curve, one mean) only when their identities are equal, and `pool_key` is the one definition
every output uses. Everything else a record holds (metrics, where it was written, when, the weights'
digest of a seeded run, the environment) is information about it, never a reason to pool or split.

Records live beside the samples they were computed from: `<benchmark folder>/records/<id>.json`, the
id a digest of identity, seeds and weights. A record is written once (`write_record`): the same
identity and seed again is the same result (nothing is written), or, with other metrics, refused; a
result of another identity gets a file of its own and never replaces one. A regrade that corrects
golds writes a record of the corrected data that `supersedes` the old one.

Results written before the ledger (`results.json`, `results/*.json`) are read as records of format 0
(`legacy_record`): the fields they lack read `UNKNOWN`, and `ledger` itself is an identity field, so
they never pool with records that have them. The reader (`stare_kernel/reader.py`) finds both.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from stare_kernel.errors import StareError
from stare_kernel.io import atomic_write_text, fsync_dir

LEDGER = 1  # the record format; 0 is what the reader makes of results written before it
RECORDS = "records"  # the folder of records, beside samples.jsonl
UNKNOWN = "unknown"  # an identity field an older results file does not record
TRAINED = "trained"  # the `weights` of a training run's evaluation: a function of recipe, seed and step

# The identity, field by field (docs/guide/evaluation.md, "What a row is"). Two records pool only where all are equal.
IDENTITY_FIELDS: tuple[str, ...] = (
    "ledger",             # record format (0: read from an older results file, its missing fields 'unknown')
    "benchmark",          # registry name, e.g. aime24
    "benchmark_version",  # the registry's version of it
    "weights",            # 'sha256:<digest>' of the weight files, 'hub:<id>', or 'trained' for a run's
    "method",             # a run's method (None for a model that is not a run's)
    "method_params",      # digest of the run's method.* keys (W, P, H_tgt, clip ranges, ...)
    "recipe",             # digest of the rest of the run's recipe, seed and bookkeeping keys left out (recipe_digest)
    "step",               # the run's training step
    "lr",                 # the learning rate of that step (a schedule is part of what a step's weights are)
    "data",               # SHA-256 of the problems and golds evaluated
    "problems",           # how many problems
    "partial",            # fewer problems than the benchmark has (--limit, a smaller file, a subset)
    "n", "temperature", "top_p", "max_tokens",  # the sampling protocol
    "template",           # the prompt template's name (paper, short, raw, r1, plain)
    "chat",               # whether the tokenizer's chat template wrapped the prompt
    "prompt",             # digest of the rendered prompt format (chat template, system prompt, tool text)
    "tools",              # the tool the model could call, or None
    "grader",             # name@version
    "engine",             # name@version of the generating package
    "dtype",              # the engine's dtype when chosen, None for its default
)
SEED_FIELDS = ("train_seed", "seed")  # the only fields that may differ inside a pooled row
# The fields that name a row (the method or the model compared); any other difference between two rows
# means they were measured differently ("more than the method or model": no best, no delta between them).
ROW_FIELDS = ("weights", "method", "method_params")

# Per-step metrics of a method's own that show it acted: never above 0 over a run's steps means the
# method ran as its baseline did (sweeps and tables mark it).
ACTING = {
    "stare/gate": "STARE's gate never opened",
    "actor/kl_frac": "KL-Cov's penalty never applied",
    "rsi/dropped": "RSI-S's interval never dropped a token",
}

# Recipe keys that do not make one run's evaluation a different thing from another's: the seed makes
# seeds of one row; names, logging, checkpointing, the evaluation protocol (in the identity already),
# the run length (a step and its learning rate are) and where or on how many devices it ran.
NOT_A_VARIANT = ("name", "description", "optim.seed", "optim.total_steps", "logging.", "checkpoint.", "eval.",
                 "backend.embedded.", "backend.verl.nnodes", "backend.verl.n_gpus_per_node", "backend.verl.shared_dir",
                 "backend.verl.device", "backend.verl.extra_overrides", "paper")


def dotted_items(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested mapping (a dumped recipe) as {"a.b.c": leaf value}."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(dotted_items(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_variant(cfg: dict) -> dict[str, object]:
    """The keys of a dumped recipe that make its runs' evaluations what they are (NOT_A_VARIANT left out)."""
    return {k: v for k, v in dotted_items(cfg).items() if not k.startswith(NOT_A_VARIANT) and k not in NOT_A_VARIANT}


def digest(obj: Any, length: int = 16) -> str:
    """The first `length` hex digits of the SHA-256 of `obj` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


def recipe_digest(cfg: dict) -> str:
    """Digest of a dumped recipe's variant keys but the method's (`method_digest`)."""
    return digest({k: v for k, v in recipe_variant(cfg).items() if not k.startswith("method.")}, 12)


def method_digest(cfg: dict) -> str:
    """Digest of a dumped recipe's method.* keys (the method's name and parameters)."""
    return digest({k: v for k, v in recipe_variant(cfg).items() if k.startswith("method.")}, 12)


def run_fields(cfg: dict) -> dict:
    """The identity fields a training run's recipe gives: method, method_params, recipe."""
    return {"method": cfg["method"]["name"], "method_params": method_digest(cfg), "recipe": recipe_digest(cfg)}


@dataclass(frozen=True)
class Record:
    """One evaluation as the ledger holds it. `identity` has every IDENTITY_FIELDS key."""

    identity: dict[str, Any]
    metrics: dict[str, Any]
    seed: Optional[int] = None          # the sampling seed
    train_seed: Optional[int] = None    # a run's training seed
    weights_digest: Optional[str] = None  # a run checkpoint's weights (their identity field says 'trained')
    path: Optional[Path] = None         # the file it was read from
    folder: Optional[Path] = None       # its benchmark folder (samples.jsonl beside)
    samples_key: Optional[str] = None   # the rows of samples.jsonl it was computed from
    written: str = ""
    evaluation: Optional[str] = None    # the `stare eval` command it was part of
    supersedes: tuple[str, ...] = ()    # ids of records it replaces (a regrade with corrected golds)
    run: Optional[dict] = None          # {"dir", "name"} of a training run's evaluation
    model_path: Optional[str] = None    # where the weights were read from (information only)
    extra: dict = field(default_factory=dict)  # the results file's other content (protocol, data, harness, ...)

    @property
    def id(self) -> str:
        return record_id(self.identity, self.seed, self.train_seed, self.weights_digest)

    @property
    def key(self) -> str:
        """The pool key: records with equal keys are seeds of one result."""
        return pool_key(self.identity)

    @property
    def seed_name(self) -> str:
        """The seed as tables show it: '1' (a run's seed, evaluated with it, or an evaluation's), '1/eval 2'."""
        return seed_name(self.train_seed, self.seed)

    @property
    def legacy(self) -> bool:
        return self.identity.get("ledger") != LEDGER

    def to_json(self) -> dict:
        return {"ledger": LEDGER, "id": self.id, "identity": self.identity, "seed": self.seed,
                "train_seed": self.train_seed, "weights_digest": self.weights_digest, "metrics": self.metrics,
                "samples_key": self.samples_key, "written": self.written, "evaluation": self.evaluation,
                "supersedes": list(self.supersedes), "run": self.run, "model_path": self.model_path, **self.extra}


def seed_name(train_seed: Optional[int], seed: Optional[int]) -> str:
    if train_seed is None:
        return "?" if seed is None else str(seed)
    return str(train_seed) if seed in (None, train_seed) else f"{train_seed}/eval {seed}"


def pool_key(identity: dict) -> str:
    """The one grouping of the ledger: identities as canonical JSON (every output pools by this)."""
    return json.dumps({k: identity.get(k, UNKNOWN) for k in IDENTITY_FIELDS}, sort_keys=True, default=str)


def record_id(identity: dict, seed: Optional[int], train_seed: Optional[int], weights: Optional[str]) -> str:
    return digest({"identity": {k: identity.get(k, UNKNOWN) for k in IDENTITY_FIELDS}, "seed": seed,
                   "train_seed": train_seed, "weights": weights})


_RECORD_KEYS = ("identity", "metrics", "seed", "train_seed", "weights_digest", "samples_key", "written",
                "evaluation", "supersedes", "run", "model_path")


def record_from_json(d: dict, path: Optional[Path] = None) -> Record:
    """A record file's content as a Record (StareError naming the file when it is not one)."""
    try:
        ident = d["identity"]
        if not isinstance(ident, dict) or not isinstance(d["metrics"], dict):
            raise TypeError("identity or metrics is not a mapping")
        missing = [k for k in IDENTITY_FIELDS if k not in ident]
        if missing:
            raise KeyError(f"identity.{missing[0]}")
        return Record(identity={k: ident[k] for k in IDENTITY_FIELDS}, metrics=d["metrics"], seed=d.get("seed"),
                      train_seed=d.get("train_seed"), weights_digest=d.get("weights_digest"), path=path,
                      folder=path.parent.parent if path is not None else None, samples_key=d.get("samples_key"),
                      written=d.get("written", ""), evaluation=d.get("evaluation"),
                      supersedes=tuple(d.get("supersedes") or ()), run=d.get("run"), model_path=d.get("model_path"),
                      extra={k: v for k, v in d.items() if k not in (*_RECORD_KEYS, "ledger", "id")})
    except (KeyError, TypeError) as e:
        raise StareError(f"{path}: not a record stare wrote ({type(e).__name__}: {e})",
                         hint="remove it; the evaluation that wrote it can be run again") from None


def write_record(folder: Path, record: Record) -> Path:
    """Write `record` under folder/records/ once. The same identity and seed again: the file already there
    is the result (identical metrics: nothing is written). Other metrics for the same identity and seed are
    refused by name: a record is never replaced."""
    path = Path(folder) / RECORDS / f"{record.id}.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and _same_numbers(old.get("metrics"), record.metrics):
            return path
        raise StareError(f"{path}: a record of this evaluation's identity and seed exists with other metrics "
                         "(an engine that is not deterministic, or samples changed by hand)",
                         hint="records are never overwritten: move that file away to record this result instead")
    atomic_write_text(path, json.dumps(record.to_json(), indent=2, default=str))
    fsync_dir(path.parent)
    return path


def _same_numbers(a, b) -> bool:
    """Equal metrics, floats compared to 1e-9 relative (a record reread from JSON round-trips exactly; this
    allows for nothing else than the last digit of a float recomputed in another summation order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_numbers(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)), abs(float(b)))
        except (TypeError, ValueError):
            return False
    return a == b


# ------------------------------------------------------------------------------------------- grouping
@dataclass
class Group:
    """Records of one identity: one per seed (a seed evaluated twice keeps its latest record; `repeated`
    names the others)."""

    identity: dict
    records: list[Record]
    repeated: list[tuple[Record, Record]] = field(default_factory=list)  # (dropped, kept)

    @property
    def key(self) -> str:
        return pool_key(self.identity)

    @property
    def seeds(self) -> list[str]:
        return [r.seed_name for r in self.records]


def group(records: Iterable[Record]) -> list[Group]:
    """Records pooled by identity (pool_key), in the order their identities first appear; within one,
    one record per seed, the latest written."""
    out: dict[str, Group] = {}
    for r in records:
        g = out.setdefault(r.key, Group(identity=r.identity, records=[]))
        same = next((x for x in g.records if (x.train_seed, x.seed) == (r.train_seed, r.seed)), None)
        if same is None:
            g.records.append(r)
            continue
        keep, drop = (r, same) if r.written >= same.written else (same, r)
        g.records[g.records.index(same)] = keep
        g.repeated.append((drop, keep))
    return list(out.values())


def differences(identities: list[dict], fields: Iterable[str] = IDENTITY_FIELDS) -> list[str]:
    """The identity fields on which `identities` disagree, as 'field a/b' ('-' for None)."""
    out = []
    for name in fields:
        vals: list = []
        for x in identities:
            v = x.get(name, UNKNOWN)
            if v not in vals:
                vals.append(v)
        if len(vals) > 1:
            out.append(f"{name} {'/'.join(short(v) for v in vals)}")
    return out


def short(v: Any) -> str:
    """An identity value as a label shows it: digests to 8 hex digits, None as '-'."""
    if v is None:
        return "-"
    s = str(v)
    if s.startswith("sha256:"):
        return s[:15]
    if len(s) >= 32 and all(c in "0123456789abcdef" for c in s):
        return s[:8]
    return s


def labels_by_difference(identities: list[dict], skip: tuple[str, ...] = ()) -> list[str]:
    """For each identity, 'field=value, ...' over the fields on which the list disagrees (not `skip`):
    the part of a label that tells its row, curve or audit entry from the others."""
    differ = [f for f in IDENTITY_FIELDS if f not in skip
              and len({json.dumps(x.get(f, UNKNOWN), default=str) for x in identities}) > 1]
    return [", ".join(f"{f}={short(x.get(f, UNKNOWN))}" for f in differ) for x in identities]


def run_acted(run_dir: Path, step: Optional[int]) -> Optional[str]:
    """Why a training run's method never acted up to `step` (a metric of ACTING logged at every step and
    never above 0), or None when it acted, logs none of them, or the run's metrics are not there."""
    from stare_kernel.io import read_jsonl

    rows = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
            if isinstance(r.get("step"), int) and (step is None or r["step"] <= step)]
    for key, why in ACTING.items():
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals and max(vals) <= 0:
            return f"{why} ({len(vals)} of {len(vals)} steps)"
    return None


def now_iso() -> str:
    """The time a record is written, to the microsecond (orders two records of one seed)."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="microseconds")


def is_run_dir(path: Path) -> bool:
    """A training run directory: its config.yaml and meta.json (stare_cli/core/runs.py writes them)."""
    return (Path(path) / "config.yaml").is_file() and (Path(path) / "meta.json").is_file()


def enclosing_run(path: Path) -> Optional[Path]:
    """The run directory `path` lies in (itself included), or None."""
    p = Path(os.path.abspath(path))
    for q in (p, *p.parents):
        if is_run_dir(q):
            return q
    return None
