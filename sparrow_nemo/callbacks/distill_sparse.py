"""DistillSparse: a LoRA adapter that only the sparse rollout uses, taught each step by the dense policy.

After each policy step (``on_train_batch_end``) the policy is frozen and the adapter takes ``steps``
AdamW updates (learning rate = ``lr_multiplier`` x the policy's) on

    loss = pg_coef * sparse PG + kl_coef * mean_t k3(t),   k3 = r - 1 - log r,  r = p_dense / q_sparse

over the sampled response tokens, where ``q_sparse`` is the policy's sparse teacher-forced forward
*with* the adapter (:meth:`MegatronPolicy.sparse_logprobs`: the same pages the engine attended to) and
``p_dense`` the dense log-probs (reused when the trainer supplies them). The sparse PG term
``-A * exp(log q - log q_rollout)`` uses the policy step's advantages and needs the step's rollouts
(:class:`DistillData` on ``trainer.distill_data``); without them the adapter learns from the KL alone
on the callback's own probe rollouts. The updated adapter goes to the engine (``set_lora``), so the
next rollouts, the trainer's acceptance-rate tail and the ``TailMismatchScheduler`` see it.

Every step it logs, on a fixed probe set (``trainer.calibration_prompts``, fixed seeds, the current
schedule), the per-bin p5 of the acceptance rate and the mean k3 KL before and after the update:
``distill/p5_before/bin_{b}``, ``distill/p5_after/bin_{b}``, ``distill/kl_before``, ``distill/kl_after``,
``distill/loss``. The adapter and its optimizer state are saved in the trainer's checkpoints (tensors in its torch file).

Process model: a ``collective`` callback, run on every rank of the policy. Each rank holds the step's
rollouts, advantages and dense log-probs (rank 0 broadcasts the rollouts, the dense pass is collective),
so every rank takes the same adapter steps (collective over TP/PP; each DP rank trains on the whole batch,
the DP gradient mean of equal gradients changes nothing) and the adapter export gathers its TP shards. The
rank holding the rollout engine (rank 0) alone probes, logs and sends the adapter to the engine. Checkpoint
state: the whole adapter in HF names (loaded into every rank's shards) and every rank's optimizer state (TP
shards differ), gathered to rank 0; a resume needs the same layout, as the policy's own checkpoint does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.callbacks.base import Callback, StepReport, TrainerLike
from sparrow_nemo.grpo.rollout_step import collate, concat_outputs, micro_batches
from sparrow_nemo.grpo.setup import broadcast_from_rank0
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.lora import LoraConfig
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.sparse_forward import SparsePattern, SparsePlan
from sparrow_nemo.policy.train_step import StepResult
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.lora import LoraAdapter
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.scoring import TokenMismatch, measure_mismatch
from sparrow_nemo.sparse.mismatch import tail_by_bin

logger = logging.getLogger(__name__)

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DistillSettings:
    """DistillSparse hyper-parameters (the recipe's ``distill`` section; defaults as in METHOD.md).

    Attributes:
        steps: adapter updates per RL step.
        lr_multiplier: adapter learning rate = policy learning rate x this.
        kl_coef, pg_coef: weights of the k3 KL and of the sparse PG loss.
        lora_rank, lora_alpha: adapter rank and alpha (scaling alpha / rank).
        target_modules: HF linear names that get an adapter.
        grad_clip: adapter gradient L2-norm clip (0 = off).
        seed: adapter initialisation and probe sampling seed.
    """

    steps: int = 1
    lr_multiplier: float = 5.0
    kl_coef: float = 1.0
    pg_coef: float = 1.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ALL_LINEARS
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        for name in ("steps", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillSparse: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr_multiplier", "lora_alpha"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DistillSparse: {name} must be > 0, got {getattr(self, name)}")
        for name in ("kl_coef", "pg_coef", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"DistillSparse: {name} must be >= 0, got {getattr(self, name)}")
        if self.kl_coef == 0 and self.pg_coef == 0:
            raise ValueError("DistillSparse: kl_coef and pg_coef are both 0, the adapter would never learn")

    def lora_config(self) -> LoraConfig:
        return LoraConfig.from_hf_targets(self.lora_rank, self.lora_alpha, self.target_modules)


@dataclass
class DistillData:
    """The RL step's rollouts for the sparse PG term (set by the trainer as ``trainer.distill_data``).

    Attributes:
        samples: the step's rollouts (generated with the adapter).
        advantages: [N] float, one per sample (the policy step's); None = no PG term.
        dense_logprobs: [N, S-1] float, the policy's dense log-probs of the padded step batch (``collate``
            layout), reused for the KL; None = recomputed after the policy step.
    """

    samples: list[RolloutSample]
    advantages: torch.Tensor | None
    dense_logprobs: torch.Tensor | None = None


def k3(sparse_logprobs: torch.Tensor, dense_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sparse || dense) on tokens sampled from the sparse policy.

    ``k3 = r - 1 - log r`` with ``log r = log p_dense - log q_sparse``: >= 0, unbiased for the KL under q.
    Differentiable in both arguments; same shape as the inputs.
    """
    log_r = dense_logprobs - sparse_logprobs
    return torch.exp(log_r) - 1.0 - log_r


def distill_loss_fn(kl_coef: float, pg_coef: float):
    """``loss_fn`` for :meth:`MegatronPolicy.lora_train_step` (token mean over ``extras['mask']``).

    Reads ``extras``: ``mask`` [b, S-1] bool, ``dense_logprobs`` and ``rollout_logprobs`` [b, S-1] float,
    ``advantages`` [b] float (the PG term is dropped when it is absent).
    """

    def loss_fn(out: LogprobOutput, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x = batch.extras
        mask = x["mask"].to(out.logprobs.device).float()
        n = mask.sum().clamp(min=1.0)
        kl = (k3(out.logprobs, x["dense_logprobs"].to(out.logprobs)) * mask).sum() / n
        loss = kl_coef * kl
        metrics = {"kl": float(kl.detach())}
        if "advantages" in x and pg_coef > 0:
            ratio = torch.exp(out.logprobs - x["rollout_logprobs"].to(out.logprobs))
            pg = -(x["advantages"].to(out.logprobs)[:, None] * ratio * mask).sum() / n
            loss = loss + pg_coef * pg
            metrics["pg"] = float(pg.detach())
        return loss, metrics

    return loss_fn


def _world() -> tuple[int, int]:
    """(this process's global rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_to_rank0(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state`` on rank 0, by global rank (other ranks get only their own). Collective."""
    rank, world = _world()
    if world == 1:
        return [state]
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(state, parts, dst=0)
    return parts if rank == 0 else [state]


def _rank_entry(states: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> Mapping[str, Any]:
    """This rank's entry of a by-rank list saved by :func:`_gather_to_rank0` (the run's world size must match).

    A single state dict (the format of single-process checkpoints before the by-rank list) is rank 0's.
    """
    if isinstance(states, Mapping):
        states = [states]
    rank, world = _world()
    if len(states) != world:
        raise ValueError(
            f"DistillSparse checkpoint: adapter optimizer states of {len(states)} ranks, this run has {world} "
            "(resume with the layout that saved it)"
        )
    return states[rank]


class DistillSparse(Callback):
    """The DistillSparse callback. Arguments left None come from the recipe's ``distill`` section.

    Args: see :class:`DistillSettings`.
    """

    collective = True

    def __init__(
        self,
        steps: int | None = None,
        lr_multiplier: float | None = None,
        kl_coef: float | None = None,
        pg_coef: float | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
        grad_clip: float | None = None,
        seed: int | None = None,
    ) -> None:
        given = {
            "steps": steps,
            "lr_multiplier": lr_multiplier,
            "kl_coef": kl_coef,
            "pg_coef": pg_coef,
            "lora_rank": lora_rank,
            "lora_alpha": lora_alpha,
            "target_modules": target_modules,
            "grad_clip": grad_clip,
            "seed": seed,
        }
        self.overrides = {k: v for k, v in given.items() if v is not None}
        self.settings = DistillSettings(**self.overrides)  # validates the overrides early
        self.optimizer = None
        self.pattern: SparsePattern | None = None
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._resume: Mapping[str, Any] | None = None

    # ----------------------------------------------------------------- hooks
    def on_train_start(self, trainer: TrainerLike) -> None:
        config = trainer.config
        d = config.distill
        recipe = {f.name: getattr(d, f.name) for f in fields(DistillSettings) if hasattr(d, f.name)}
        self.settings = replace(DistillSettings(**recipe), **self.overrides)
        engine = trainer.rollout_engine
        self.pattern = broadcast_from_rank0(
            None
            if engine is None
            else SparsePattern(engine.page_size, engine.sink_pages, engine.local_pages, engine.dense_layers)
        )
        s = self.settings
        adapter = None
        if self._resume is not None:
            saved = self._resume["adapter"]
            adapter = LoraAdapter(weights=dict(saved["weights"]), scaling=float(saved["scaling"]))
        trainer.policy.enable_lora(s.lora_config(), adapter, seed=s.seed)
        self.optimizer = trainer.policy.lora_optimizer(
            OptimizerSettings(
                lr=config.policy.optimizer.lr * s.lr_multiplier, weight_decay=0.0, grad_clip=s.grad_clip
            )
        )
        if self._resume is not None:
            self.optimizer.load_state_dict(self._resume["optimizer"])
            self.step = int(self._resume["step"])
            self.history = list(self._resume["history"])
            self._resume = None
        adapter = trainer.policy.lora.export_adapter()
        if engine is not None:
            engine.set_lora(adapter)

    def on_train_batch_end(
        self, trainer: TrainerLike, report: StepReport, metrics: Mapping[str, float]
    ) -> None:
        if self.optimizer is None:
            raise RuntimeError("DistillSparse: on_train_start was not called")
        main = trainer.rollout_engine is not None  # rank 0: probes with the engine, logs
        probe_samples, before = self._probe(trainer) if main else (None, None)
        data: DistillData | None = getattr(trainer, "distill_data", None)
        if data is None:
            data = DistillData(samples=broadcast_from_rank0(probe_samples), advantages=None)
        results = self.train_adapter(trainer, data)
        if not main:
            self.step += 1
            return
        _, after = self._probe(trainer)
        q = trainer.config.sparsity.quantile
        tail_before = tail_by_bin(before.alpha, before.cached_len, trainer.schedule.bin_tokens, q)
        tail_after = tail_by_bin(after.alpha, after.cached_len, trainer.schedule.bin_tokens, q)
        entry = {
            "step": self.step,
            "p5_before": {str(b): v for b, v in tail_before.items()},
            "p5_after": {str(b): v for b, v in tail_after.items()},
            "kl_before": _mean_k3(before),
            "kl_after": _mean_k3(after),
            "loss_first": results[0].loss,
            "loss": results[-1].loss,
            "grad_norm": results[0].grad_norm,
        }
        if "pg" in results[-1].metrics:  # the sparse PG term ran (pg_coef > 0 and the step's rollouts given)
            entry["pg"] = results[-1].metrics["pg"]
        self.history.append(entry)
        logged = {
            "distill/kl_before": entry["kl_before"],
            "distill/kl_after": entry["kl_after"],
            "distill/loss": entry["loss"],
            "distill/grad_norm": entry["grad_norm"],
            "distill/skipped_nonfinite": float(sum(r.skipped is not None for r in results)),
        }
        if "pg" in entry:
            logged["distill/pg"] = entry["pg"]
        logged.update({f"distill/p5_before/bin_{b}": v for b, v in tail_before.items()})
        logged.update({f"distill/p5_after/bin_{b}": v for b, v in tail_after.items()})
        trainer.log(logged)
        self.step += 1

    def on_save_checkpoint(self, trainer: TrainerLike) -> dict[str, Any]:
        """``step``, ``history`` (JSON) and the tensors: ``adapter`` (HF-named A/B pairs, scaling) and
        ``optimizer``, the adapter optimizer's state dict of every rank (a list by global rank); the trainer
        stores tensor entries in a torch file. Collective (every rank calls it; rank 0's return is complete)."""
        if trainer.policy.lora is None or self.optimizer is None:
            return {}
        adapter = trainer.policy.lora.export_adapter()
        weights = {name: (a.clone(), b.clone()) for name, (a, b) in adapter.weights.items()}
        return {
            "step": self.step,
            "history": self.history,
            "adapter": {"weights": weights, "scaling": adapter.scaling},
            "optimizer": _gather_to_rank0(self.optimizer.state_dict()),
        }

    def on_load_checkpoint(self, trainer: TrainerLike, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("step", "history", "adapter", "optimizer") if k not in state]
        if missing:
            raise ValueError(f"DistillSparse checkpoint state lacks {missing}")
        self._resume = {**state, "optimizer": _rank_entry(state["optimizer"])}  # this rank's optimizer state

    def train_adapter(self, trainer: TrainerLike, data: DistillData) -> list[StepResult]:
        """``settings.steps`` adapter updates on ``data`` (policy frozen), then the adapter goes to the engine.

        Returns the :class:`StepResult` of every update (loss, grad norm, ``kl`` / ``pg`` metrics).
        """
        if self.optimizer is None:
            raise RuntimeError("DistillSparse: on_train_start was not called")
        s, policy = self.settings, trainer.policy
        batches, plans = self._batches(trainer, data)
        loss_fn = distill_loss_fn(s.kl_coef, s.pg_coef)
        results = [
            policy.lora_train_step(batches, plans, self.pattern, loss_fn, self.optimizer)
            for _ in range(s.steps)
        ]
        adapter = policy.lora.export_adapter()  # collective: gathers the TP / PP shards
        if trainer.rollout_engine is not None:
            trainer.rollout_engine.set_lora(adapter)
        return results

    # ----------------------------------------------------------------- pieces
    def _probe(self, trainer: TrainerLike) -> tuple[list[RolloutSample], TokenMismatch]:
        """Rollouts of the probe prompts (fixed seeds, current schedule and adapter) and their mismatch."""
        prompts = trainer.calibration_prompts
        seeds = [sample_seed(self.settings.seed, i) for i in range(len(prompts))]
        batch = trainer.rollout_engine.generate(
            prompts, trainer.sampling, trainer.schedule, sample_seeds=seeds
        )
        return batch.samples, measure_mismatch(trainer.rollout_engine, batch)

    def _batches(self, trainer: TrainerLike, data: DistillData) -> tuple[list[PolicyBatch], list[SparsePlan]]:
        """Micro-batches (extras for :func:`distill_loss_fn`) and their sparse plans from the engine's budgets."""
        n = len(data.samples)
        advantages = data.advantages if data.advantages is not None else torch.zeros(n)
        rt = collate(data.samples, advantages.float())
        size = trainer.config.policy.micro_batch_size
        size = size if n % size == 0 else n
        extras = {"mask": rt.response_mask, "rollout_logprobs": rt.rollout_logprobs}
        if data.advantages is not None:
            extras["advantages"] = rt.advantages
        dense = data.dense_logprobs
        if dense is None:
            plain = micro_batches(rt.tokens, rt.lengths, {}, size)
            dense = concat_outputs(trainer.policy.logprobs(plain)).logprobs
        extras["dense_logprobs"] = dense
        batches = micro_batches(rt.tokens, rt.lengths, extras, size)
        width = rt.tokens.shape[1]
        plans = []
        for lo in range(0, n, size):
            part = data.samples[lo : lo + size]
            plans.append(
                SparsePlan.from_rollouts(
                    [s.prompt_ids.numel() for s in part], [s.kv_budget for s in part], width
                )
            )
        return batches, plans


def _mean_k3(mismatch: TokenMismatch) -> float:
    """Mean k3 KL(sparse || dense) over the sampled tokens of a measured batch."""
    if mismatch.alpha.numel() == 0:
        return math.nan
    return float(k3(mismatch.gen_logprobs.float(), mismatch.train_logprobs.float()).mean())
