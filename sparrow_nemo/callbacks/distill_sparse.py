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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.callbacks.base import Callback, StepReport, TrainerLike
from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Section, choices, knob, suggest
from sparrow_nemo.grpo.rollout_step import collate, concat_outputs, micro_batches
from sparrow_nemo.grpo.world import broadcast_from_rank0
from sparrow_nemo.hf_qwen3 import LINEARS, LoraAdapter
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.lora import LoraConfig
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.sparse_forward import SparsePlan
from sparrow_nemo.policy.train_step import StepResult
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.scoring import TokenMismatch, measure_mismatch
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.pattern import SparsePattern

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig(Section):
    """DistillSparse: the recipe's ``distill`` section (defaults as in docs/METHOD.md).

    ``enabled`` means the trainer builds :class:`DistillSparse` (it is not listed under ``callbacks``).
    """

    enabled: bool = knob(False, "train the rollout-only LoRA each step (the trainer builds DistillSparse)")
    lora_rank: int = knob(8, "LoRA rank", check=AT_LEAST_ONE)
    lora_alpha: float = knob(16.0, "LoRA alpha (scaling = alpha / rank)", check=POSITIVE)
    target_modules: tuple[str, ...] = knob(
        LINEARS, "HF Qwen3 linear names that get an adapter (default: all of them, as in the paper)"
    )
    lr_multiplier: float = knob(5.0, "adapter learning rate = policy.optimizer.lr x this", check=POSITIVE)
    steps: int = knob(1, "adapter updates per RL step", check=AT_LEAST_ONE)
    kl_coef: float = knob(
        1.0, "weight of KL(sparse || dense) (k3 estimator on the sampled tokens)", check=NON_NEGATIVE
    )
    pg_coef: float = knob(
        1.0,
        "weight of the sparse policy-gradient loss (same advantages as the policy step)",
        check=NON_NEGATIVE,
    )
    grad_clip: float = knob(1.0, "adapter gradient L2-norm clip; 0 = off", check=NON_NEGATIVE)
    seed: int = knob(0, "adapter initialisation and probe sampling seed", check=NON_NEGATIVE)

    def check(self) -> None:
        if not self.target_modules:
            raise self.invalid("target_modules", f"at least one of {choices(LINEARS)}")
        for i, name in enumerate(self.target_modules):
            if name not in LINEARS:
                raise self.invalid(
                    f"target_modules.{i}", f"one of {choices(LINEARS)}{suggest(name, LINEARS)}"
                )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise self.invalid("target_modules", "each module named once")
        if self.kl_coef == 0 and self.pg_coef == 0:
            raise self.invalid("kl_coef", "> 0 or pg_coef > 0 (with both 0 the adapter never learns)")

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
    """The DistillSparse callback, built by the trainer when ``distill.enabled``.

    Args:
        settings: the recipe's ``distill`` section.
    """

    collective = True

    def __init__(self, settings: DistillConfig) -> None:
        self.settings = settings
        self.optimizer = None
        self.pattern: SparsePattern | None = None
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._resume: Mapping[str, Any] | None = None

    # ----------------------------------------------------------------- hooks
    def on_train_start(self, trainer: TrainerLike) -> None:
        config = trainer.config
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
