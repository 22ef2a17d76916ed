"""Supervised warm-start on the task's reference solutions, cached as an HF checkpoint directory.

RL needs a policy that already solves part of the task. For the synthetic task a short SFT on generated
(prompt, solution) pairs gives one: the loss is the mean NLL of the solution tokens (eos included) given
the prompt. The result is written once, atomically (staging folder + rename), to
``<cache>/<key>/`` where ``key`` hashes everything that determines it (:func:`cache_key`), and later runs
load it without training.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from sparrow_nemo.grpo.objective import sft_loss_fn
from sparrow_nemo.grpo.prompt_source import PromptSource
from sparrow_nemo.grpo.recipe import SparrowConfig
from sparrow_nemo.grpo.rollout_step import pad_pairs
from sparrow_nemo.policy.packing import micro_batches
from sparrow_nemo.run_io.progress import progress

logger = logging.getLogger(__name__)

#: the sources whose code decides the warm-start's weights (paths under sparrow_nemo/; a folder = every .py in
#: it but :data:`PLANNING_ONLY`): the model, its forward/backward and optimizer, the loss, the batches and the
#: task's data. Their code (not their docstrings and comments: :func:`source_digest`) is in the cache key, so a
#: change to any of them (a new attention path, another summation order) trains anew instead of reusing weights
#: the code no longer produces.
WARMSTART_SOURCES = (
    "policy",
    "tasks",
    "grpo/warmstart.py",
    "grpo/objective.py",
    "grpo/losses.py",
    "grpo/rollout_step.py",
    "grpo/prompt_source.py",
    "grpo/prompts.py",
    "model_shapes.py",
    "hf_qwen3.py",
)
#: modules in those folders that only plan memory (no training numerics): not in the key
PLANNING_ONLY = ("policy/plan.py", "policy/engine_memory.py")


#: warm-start checkpoints shipped with the package, one ``<key>/`` folder each (scripts/ship_warmstart.py)
SHIPPED_ROOT = Path(__file__).resolve().parents[1] / "tasks" / "warmstart"
#: in a shipped folder: {"key", "sha256": {file: hex digest}, and how it was made}
MANIFEST = "manifest.json"


def source_digest(sources: tuple[str, ...] = WARMSTART_SOURCES) -> str:
    """sha256 over the path and code of every file of ``sources`` (sorted, :data:`PLANNING_ONLY` left out), e.g.
    :data:`WARMSTART_SOURCES`. The code is the file's syntax tree without docstrings (comments are not in it),
    so documentation edits keep the key."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(
        f for s in sources for f in ((root / s).rglob("*.py") if (root / s).is_dir() else [root / s])
    )
    digest = hashlib.sha256()
    for f in files:
        name = f.relative_to(root).as_posix()
        if name not in PLANNING_ONLY:
            digest.update(name.encode() + b"\0" + _code(f.read_text()).encode() + b"\0")
    return digest.hexdigest()


def _code(text: str) -> str:
    """The syntax tree of a module's source without its docstrings, as text (``ast.dump``)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def cache_root(config: SparrowConfig) -> Path:
    """``warmstart.cache_dir``, else ``$SPARROW_CACHE/warmstart``, else ``~/.cache/sparrow_nemo/warmstart``."""
    if config.warmstart.cache_dir is not None:
        return Path(config.warmstart.cache_dir).expanduser()
    base = os.environ.get("SPARROW_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "sparrow_nemo") / "warmstart"


#: (tensor parallel, pipeline parallel, world size) of a warm-start trained in one process
SINGLE_RANK = (1, 1, 1)


def cache_key(config: SparrowConfig, tokenizer_name: str, layout: tuple[int, int, int] | None = None) -> str:
    """16 hex digits identifying the warm-start result: every input that changes the weights.

    Besides the recipe's model, task and warm-start settings that is the optimizer (only ``lr`` is the
    warm-start's own), the parallel layout and world size (sharded matmuls, the DP gradient mean; ``layout``
    = (tp, pp, world size), default this run's), the device type, the torch and megatron-core versions
    (kernels) and the code that trains (:func:`source_digest`: measured, the memory-efficient attention
    path gave other weights under an unchanged key). The CPU thread count is not an input: the warm-start
    always trains with one intra-op thread (:func:`_one_cpu_thread`), so it cannot change the sums.
    """
    import megatron.core

    from sparrow_nemo.grpo.setup import device
    from sparrow_nemo.grpo.world import world_size
    from sparrow_nemo.tasks.chain import build_tasks

    w, p = config.warmstart, config.policy
    warm_task = build_tasks(config.task, w)[1]
    stage = _init_stage(config)
    optimizer = {k: v for k, v in asdict(p.optimizer).items() if k != "lr"}
    spec = {
        "code": source_digest(),
        "megatron_core": megatron.core.__version__,
        "shape": asdict(config.model.shape()),
        # the problems the warm-start trains on (warmstart.num_hops/num_nodes, else the task's sizes) and
        # how they grow (warmstart.ramp_steps)
        "task": asdict(warm_task.config),
        "warmstart": {
            "steps": w.steps,
            "batch_size": w.batch_size,
            "lr": w.lr,
            "ramp": warm_task.ramp_problems,
            "late_ramp": warm_task.late_ramp,
        },
        "optimizer": optimizer,
        "micro_batch_size": p.micro_batch_size,
        "precision": p.precision,
        "layout": list(
            layout or (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, world_size())
        ),
        "device": device(config).type,
        "torch": torch.__version__,
        "seed": config.trainer.seed,
        "tokenizer": tokenizer_name,
        # the checkpoint it starts from (warmstart.init_from): that warm-start's own key
        "init_from": None if stage is None else cache_key(stage[0], tokenizer_name, layout),
    }
    text = json.dumps(spec, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _init_stage(config: SparrowConfig) -> tuple[SparrowConfig, PromptSource] | None:
    """(config, prompt source) of the recipe named by ``warmstart.init_from``, or None."""
    if config.warmstart.init_from is None:
        return None
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.recipe import load_config

    stage = load_config(config.warmstart.init_from, [f"warmstart.cache_dir={cache_root(config)}"])
    if stage.warmstart.init_from is not None:
        raise ValueError(
            f"warmstart.init_from={config.warmstart.init_from}: that recipe continues "
            f"{stage.warmstart.init_from} itself; one stage deep only"
        )
    return stage, build_prompt_source(stage)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_checkpoint(key: str) -> Path | None:
    """The shipped warm-start folder of ``key`` after checking its files against its manifest, or None.

    Raises ValueError naming the file and both digests when a file is missing or differs.
    """
    folder = SHIPPED_ROOT / key
    if not (folder / MANIFEST).is_file():
        return None
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("key") != key or not manifest.get("sha256"):
        raise ValueError(f"shipped warm-start {folder / MANIFEST}: expected key {key} and a sha256 table")
    for name, want in manifest["sha256"].items():
        got = file_sha256(folder / name) if (folder / name).is_file() else "missing"
        if got != want:
            raise ValueError(
                f"shipped warm-start {folder / name}: sha256 {got[:16]}, the manifest says {want[:16]} "
                "(a damaged or edited checkpoint: restore it, or remake it with scripts/ship_warmstart.py)"
            )
    return folder


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """One torch intra-op thread inside (the caller's count restored after): CPU reductions then add in
    one order whatever ``trainer.cpu_threads`` or torch's default (one per core) would have been."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start_dir(
    config: SparrowConfig, source: PromptSource, layout: tuple[int, int, int] | None = None
) -> Path:
    """Where the warm-start checkpoint of this recipe (trained in ``layout``, default this run's) lives; it
    may not exist yet."""
    return cache_root(config) / cache_key(config, type(source.tokenizer).__name__, layout)


def cached_warm_start(config: SparrowConfig, source: PromptSource) -> Path | None:
    """The cached warm-start this run starts from: the single-rank one when it exists (an HF checkpoint serves
    any layout, so runs of every layout start from the same weights), else this run's own layout's; None
    when neither exists (then this run trains it, under its own layout's key)."""
    for path in (warm_start_dir(config, source, SINGLE_RANK), warm_start_dir(config, source)):
        if (path / "config.json").is_file():
            return path
    return None


def _sft_batch(
    source: PromptSource, pairs, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [b, S], lengths [b], solution mask [b, S-1]) of the next ``batch_size`` pairs."""
    tok = source.tokenizer
    prompts, solutions = [], []
    for _ in range(batch_size):
        prompt, solution = next(pairs)
        prompts.append(torch.tensor(tok.encode(prompt, add_special_tokens=True), dtype=torch.int64))
        solutions.append(torch.tensor([*tok.encode(solution), tok.eos_token_id], dtype=torch.int64))
    return pad_pairs(prompts, solutions, tok.pad_token_id)


def run_warm_start(config: SparrowConfig, source: PromptSource, policy, show_progress: bool) -> list[float]:
    """Train ``policy`` in place for ``warmstart.steps`` SFT steps; returns the loss per step.

    Collective over the ranks (every rank builds the same batches; DP rank r trains on micro-batches
    r, r + dp, ...).
    """
    if source.warm_start_pairs is None:
        raise ValueError(
            f"warmstart.enabled=true but reward.type={config.reward.type} has no reference solutions; "
            "set warmstart.enabled=false or give model.hf_checkpoint"
        )
    from megatron.core import parallel_state as ps

    w = config.warmstart
    pairs = source.warm_start_pairs(0)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses = []
    bar = progress(range(w.steps), enabled=show_progress, desc="warm-start", unit="step")
    for i in bar:
        tokens, lengths, mask = _sft_batch(source, pairs, w.batch_size)
        batches = micro_batches(tokens, lengths, {"mask": mask}, config.policy.micro_batch_size)
        result = policy.train_step(batches[dp_rank::dp], sft_loss_fn)
        losses.append(result.loss)
        bar.set_postfix(nll=f"{result.loss:.3f}")
        if not show_progress and (i + 1) % max(1, w.steps // 10) == 0:
            logger.info("warm-start: step %d/%d, solution NLL %.3f", i + 1, w.steps, result.loss)
    return losses


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging folders of ``target`` that a killed save left (``.<key>.partial-<host>-<pid>``
    of this host whose process is gone; also the older ``.<key>.partial-<pid>``); returns them.

    A staging folder of a live process, or of another host sharing the cache, is left alone.
    """
    removed = []
    host = socket.gethostname()
    for path in target.parent.glob(f".{target.name}.partial-*"):
        owner = path.name.rsplit(".partial-", 1)[1]
        where, _, pid = owner.rpartition("-")
        if (where or host) == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("warm-start: removed %d staging folder(s) of killed saves: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _publish(staging: Path, target: Path) -> None:
    """Rename a finished ``staging`` folder to ``target`` (atomic); keep ``target`` if another process won."""
    try:
        os.replace(staging, target)
    except OSError:  # another process finished the same warm-start first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)


def ensure_warm_start(
    config: SparrowConfig, source: PromptSource, show_progress: bool = True, use_shipped: bool = True
) -> Path:
    """The warm-start checkpoint directory: the cache entry, else the shipped checkpoint of the same key
    (hash-checked, copied into the cache), else trained now and cached.

    Collective: every rank calls it; rank 0 writes the cache. Training builds (and discards) its own policy
    with the warm-start learning rate, so the RL policy starts with fresh optimizer state.
    ``use_shipped=False`` trains even when a shipped checkpoint exists (scripts/ship_warmstart.py).
    """
    from sparrow_nemo.grpo.process_model import broadcast_object
    from sparrow_nemo.grpo.world import rank

    target = warm_start_dir(config, source)
    if rank() == 0:
        remove_stale_staging(target)
    cached = broadcast_object(str(cached_warm_start(config, source) or "") if rank() == 0 else None)
    if cached:
        logger.info("warm-start: using the cached checkpoint %s", cached)
        return Path(cached)
    shipped = broadcast_object(shipped_checkpoint(target.name) if use_shipped and rank() == 0 else None)
    if shipped is not None:
        if rank() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = target.parent / f".{target.name}.partial-{socket.gethostname()}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(shipped, staging)
            _publish(staging, target)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        logger.info("warm-start: using the shipped checkpoint %s (sha256 checked)", shipped)
        return target
    return _train_and_cache(config, source, target, show_progress)


def _train_and_cache(config: SparrowConfig, source: PromptSource, target: Path, show_progress: bool) -> Path:
    """Train the warm-start (one CPU thread) and write it to ``target`` atomically (rank 0)."""
    from sparrow_nemo.grpo.setup import build_policy
    from sparrow_nemo.grpo.world import rank
    from sparrow_nemo.hf_qwen3 import save_hf_checkpoint

    stage = _init_stage(config)
    start = None if stage is None else ensure_warm_start(*stage, show_progress)
    logger.info(
        "warm-start: %d SFT steps from %s (cached afterwards in %s)",
        config.warmstart.steps,
        start or "random weights",
        target,
    )
    with _one_cpu_thread():
        torch.manual_seed(config.trainer.seed)
        policy = build_policy(config, hf_dir=start, lr=config.warmstart.lr)
        losses = run_warm_start(config, source, policy, show_progress)
        weights = policy.export_hf()
    if rank() == 0:
        staging = target.parent / f".{target.name}.partial-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        save_hf_checkpoint(weights, config.model.shape(), staging)
        (staging / "warmstart.json").write_text(json.dumps({"losses": losses}) + "\n")
        _publish(staging, target)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return target
