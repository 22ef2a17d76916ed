"""The DistillSparse phase: a LoRA adapter that only the sparse rollout uses, taught each step by the dense policy.

Configured by the recipe's ``distill:`` section (:class:`DistillConfig`, below); with
``distill.enabled=true`` the trainer builds it and runs it after every policy update. The policy is frozen and
the adapter takes ``distill.steps`` AdamW updates (learning rate = ``lr_multiplier`` x the policy's) on

    loss = pg_coef * sparse PG + kl_coef * mean_t k3(t),   k3 = r - 1 - log r,  r = p_dense / q_sparse

over the sampled response tokens of the step, where ``q_sparse`` is the policy's sparse teacher-forced forward
*with* the adapter (:meth:`MegatronPolicy.sparse_logprobs`: the pages the engine attended to, from each
token's recorded KV budget) and ``p_dense`` the step's dense log-probs (computed before the policy update).
The sparse PG term ``-A * exp(log q - log q_rollout)`` uses the step's advantages. The new adapter then goes
to every engine (``set_lora``), so the next rollouts and the acceptance-rate tail see it.

Process model: every rank runs the phase on its data-parallel replica's rows of the step (the
:class:`~sparrow_nemo.grpo.step_batch.StepBatch`); the adapter's gradient is averaged over data-parallel ranks
and its TP shards gathered for the export, which reaches every rank's engine. The engine sleeps while the
adapter trains. Rank 0 also probes: on fixed prompts (``control.calibration``'s, fixed seeds, the current
schedule) it measures the per-bin p5 of the acceptance rate and the mean k3 KL before and after the update:
``distill/p5_before/bin_{b}``, ``distill/p5_after/bin_{b}``, ``distill/kl_before``, ``distill/kl_after``, plus
``distill/loss``, ``distill/grad_norm``, ``distill/pg``, ``distill/skipped_nonfinite``. Checkpoint state: the
whole adapter (HF names, loaded into every rank's shards) and every rank's optimizer state, gathered to rank
0 (over gloo); a resume needs the same layout, as the policy's own checkpoint does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Section, choices, knob, suggest
from sparrow_nemo.grpo.process_model import distributed, object_group, replica_mean
from sparrow_nemo.grpo.rollout_step import RolloutTensors, collate
from sparrow_nemo.hf_qwen3 import LINEARS, LoraAdapter
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.lora import LoraConfig
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.packing import concat_outputs, micro_batches
from sparrow_nemo.policy.sparse_forward import SparsePlan
from sparrow_nemo.policy.train_step import StepResult
from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.scoring import TokenMismatch, measure_mismatch
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

#: checkpoint key of the phase's state (the same as when DistillSparse was a callback: old checkpoints load)
STATE_KEY = "DistillSparse"


@dataclass(frozen=True)
class DistillConfig(Section):
    """DistillSparse: the recipe's ``distill`` section (defaults as in docs/METHOD.md).

    ``enabled`` means the trainer builds the phase (it is never listed under ``callbacks``).
    """

    enabled: bool = knob(
        False, "train the rollout-only LoRA each step (the trainer runs the DistillSparse phase)"
    )
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
    probe_every: int = knob(
        1,
        "rank 0 probes the tail before and after the adapter update every this many RL steps (from the "
        "first); 0 = never. A probe is two sparse generates and dense scorings of the calibration prompts: "
        "at ~800-token responses on a CPU it costs several times the adapter update",
        check=NON_NEGATIVE,
    )

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


@dataclass
class DistillData:
    """What the adapter trains on: padded rows (``collate`` layout) with their sparse-rollout facts.

    Attributes:
        data: tokens [n, S], lengths, response_mask, rollout_logprobs [n, S-1] and advantages [n].
        prompt_lens: [n] int64. kv_budgets: per row [Lr] int64 KV budget of each response token.
        dense_logprobs: [n, S-1] float, the policy's dense log-probs of ``data``; None = computed here.
        use_advantages: include the sparse PG term (False: KL only).
    """

    data: RolloutTensors
    prompt_lens: torch.Tensor
    kv_budgets: list[torch.Tensor]
    dense_logprobs: torch.Tensor | None = None
    use_advantages: bool = True

    @classmethod
    def from_samples(cls, samples: Sequence[RolloutSample], advantages: torch.Tensor | None) -> DistillData:
        """Rows from rollouts (a report or benchmark outside the trainer); advantages None = KL only."""
        n = len(samples)
        adv = advantages if advantages is not None else torch.zeros(n)
        return cls(
            data=collate(samples, adv.float()),
            prompt_lens=torch.tensor([s.prompt_ids.numel() for s in samples], dtype=torch.int64),
            kv_budgets=[s.kv_budget for s in samples],
            use_advantages=advantages is not None,
        )


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


def _gather_to_rank0(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state`` on rank 0, by global rank (other ranks get only their own). Collective (gloo)."""
    if not distributed():
        return [state]
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(state, parts, dst=0, group=object_group())
    return parts if rank == 0 else [state]


def _rank_entry(states: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> Mapping[str, Any]:
    """This rank's entry of a by-rank list saved by :func:`_gather_to_rank0` (the run's world size must match).

    A single state dict (the format of single-process checkpoints before the by-rank list) is rank 0's.
    """
    if isinstance(states, Mapping):
        states = [states]
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
    if len(states) != world:
        raise ValueError(
            f"DistillSparse checkpoint: adapter optimizer states of {len(states)} ranks, this run has {world} "
            "(resume with the layout that saved it)"
        )
    return states[rank]


@dataclass(frozen=True)
class Probe:
    """Rank 0's fixed probe: ``prompts`` (one list of ids per sample) sampled with ``sampling``, sample i
    seeded ``sample_seed(seed, i)``, scored dense by the engine; tails over ``bin_tokens`` at ``quantile``."""

    prompts: list[list[int]]
    sampling: SamplingParams
    seed: int
    quantile: float

    def measure(self, engine: Any, schedule: BudgetSchedule) -> TokenMismatch:
        seeds = [sample_seed(self.seed, i) for i in range(len(self.prompts))]
        batch = engine.generate(self.prompts, self.sampling, schedule, sample_seeds=seeds)
        return measure_mismatch(engine, batch)


def _mean_k3(mismatch: TokenMismatch) -> float:
    """Mean k3 KL(sparse || dense) over the sampled tokens of a measured batch."""
    if mismatch.alpha.numel() == 0:
        return math.nan
    return float(k3(mismatch.gen_logprobs.float(), mismatch.train_logprobs.float()).mean())


class DistillSparse:
    """The phase (see the module docstring).

    Args:
        config: the recipe's ``distill`` section.
        policy_lr: the policy's learning rate (the adapter's is ``config.lr_multiplier`` times it).
        pattern: the sparse rule the engine applies (page size, sink / local pages, dense layers).
        micro_batch_size: rows per adapter micro-batch (the policy's).
    """

    #: the trainer builds it from this recipe section; ``callbacks:`` refuses it (callbacks.base)
    built_in = "distill section (distill.enabled=true)"

    def __init__(
        self, config: DistillConfig, policy_lr: float, pattern: SparsePattern, micro_batch_size: int
    ):
        self.config = config
        self.policy_lr = policy_lr
        self.pattern = pattern
        self.micro_batch_size = micro_batch_size
        self.optimizer = None
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._resume: Mapping[str, Any] | None = None

    def lora_config(self) -> LoraConfig:
        c = self.config
        return LoraConfig.from_hf_targets(c.lora_rank, c.lora_alpha, tuple(c.target_modules))

    def start(self, policy: Any, engine: Any | None) -> None:
        """Attach the adapter (the resumed one, else a fresh one with B = 0) and its optimizer; hand it to
        ``engine`` (None on a rank without one). Collective."""
        c = self.config
        adapter = None
        if self._resume is not None:
            saved = self._resume["adapter"]
            adapter = LoraAdapter(weights=dict(saved["weights"]), scaling=float(saved["scaling"]))
        policy.enable_lora(self.lora_config(), adapter, seed=c.seed)
        self.optimizer = policy.lora_optimizer(
            OptimizerSettings(lr=self.policy_lr * c.lr_multiplier, weight_decay=0.0, grad_clip=c.grad_clip)
        )
        if self._resume is not None:
            self.optimizer.load_state_dict(self._resume["optimizer"])
            self.step = int(self._resume["step"])
            self.history = list(self._resume["history"])
            self._resume = None
        exported = policy.lora.export_adapter()
        if engine is not None:
            engine.set_lora(exported)

    def run(
        self,
        policy: Any,
        engine: Any | None,
        data: DistillData,
        schedule: BudgetSchedule,
        probe: Probe | None,
    ) -> dict[str, float]:
        """One RL step's adapter updates on ``data``; with a ``probe`` (rank 0) the tail before and after,
        on the steps ``distill.probe_every`` picks.

        The engine must hold the step's policy weights (after the refit); it sleeps while the adapter trains and
        is refitted from the (frozen) policy after.
        Returns the ``distill/*`` metrics (the probe's only where it ran). Collective.
        """
        every = self.config.probe_every
        if every == 0 or self.step % every:
            probe = None
        before = probe.measure(engine, schedule) if probe is not None else None
        if engine is not None:
            engine.sleep()  # releases its weights: the refit below fills them again
        results = self.train_adapter(policy, None, data)
        if engine is not None:
            engine.wake()
        policy.refit(engine)  # collective
        self._export(policy, engine)
        metrics = {
            "distill/loss": results[-1].loss,
            "distill/grad_norm": results[0].grad_norm,
            "distill/skipped_nonfinite": float(sum(r.skipped is not None for r in results)),
        }
        if "pg" in results[-1].metrics:
            metrics["distill/pg"] = replica_mean({"pg": results[-1].metrics["pg"]})["pg"]
        entry: dict[str, Any] = {"step": self.step, "loss_first": results[0].loss, "loss": results[-1].loss}
        if probe is not None and before is not None:
            after = probe.measure(engine, schedule)
            tails = {
                tag: tail_by_bin(m.alpha, m.cached_len, schedule.bin_tokens, probe.quantile)
                for tag, m in (("before", before), ("after", after))
            }
            entry.update(
                {f"p5_{tag}": {str(b): v for b, v in t.items()} for tag, t in tails.items()},
                kl_before=_mean_k3(before),
                kl_after=_mean_k3(after),
            )
            metrics["distill/kl_before"], metrics["distill/kl_after"] = entry["kl_before"], entry["kl_after"]
            for tag, t in tails.items():
                metrics.update({f"distill/p5_{tag}/bin_{b}": v for b, v in t.items()})
        self.history.append(entry)
        self.step += 1
        return metrics

    def train_adapter(self, policy: Any, engine: Any | None, data: DistillData) -> list[StepResult]:
        """``distill.steps`` adapter updates on ``data`` (policy frozen); with an ``engine`` it gets the new
        adapter. Returns the :class:`StepResult` of every update (loss, grad norm, ``kl`` / ``pg``). Collective."""
        if self.optimizer is None:
            raise RuntimeError("DistillSparse: start() was not called")
        c = self.config
        batches, plans = self._batches(policy, data)
        loss_fn = distill_loss_fn(c.kl_coef, c.pg_coef)
        results = [
            policy.lora_train_step(batches, plans, self.pattern, loss_fn, self.optimizer)
            for _ in range(c.steps)
        ]
        if engine is not None:
            self._export(policy, engine)
        return results

    def _export(self, policy: Any, engine: Any | None) -> None:
        adapter = policy.lora.export_adapter()  # collective: gathers the TP / PP shards
        if engine is not None:
            engine.set_lora(adapter)

    def _batches(self, policy: Any, data: DistillData) -> tuple[list[PolicyBatch], list[SparsePlan]]:
        """Micro-batches (extras for :func:`distill_loss_fn`) and their sparse plans from the engine's budgets."""
        rt, n = data.data, int(data.data.tokens.shape[0])
        size = self.micro_batch_size if n % self.micro_batch_size == 0 else n
        extras = {"mask": rt.response_mask, "rollout_logprobs": rt.rollout_logprobs}
        if data.use_advantages:
            extras["advantages"] = rt.advantages
        dense = data.dense_logprobs
        if dense is None:
            plain = micro_batches(rt.tokens, rt.lengths, {}, size)
            dense = concat_outputs(policy.logprobs(plain)).logprobs
        extras["dense_logprobs"] = dense
        batches = micro_batches(rt.tokens, rt.lengths, extras, size)
        plans = []
        for b in batches:  # each micro-batch holds its rows (placement), cut to its longest one
            rows = b.placement.rows.tolist() if b.placement is not None else range(len(b.lengths))
            plans.append(
                SparsePlan.from_rollouts(
                    [int(data.prompt_lens[r]) for r in rows],
                    [data.kv_budgets[r] for r in rows],
                    b.tokens.shape[1],
                )
            )
        return batches, plans

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self, policy: Any) -> dict[str, Any]:
        """``step``, ``history`` (JSON) and the tensors: ``adapter`` (HF-named A/B pairs, scaling) and
        ``optimizer``, the adapter optimizer's state dict of every rank (a list by global rank). Collective;
        rank 0's return is complete."""
        if policy.lora is None or self.optimizer is None:
            return {}
        adapter = policy.lora.export_adapter()
        weights = {name: (a.clone(), b.clone()) for name, (a, b) in adapter.weights.items()}
        return {
            "step": self.step,
            "history": self.history,
            "adapter": {"weights": weights, "scaling": adapter.scaling},
            "optimizer": _gather_to_rank0(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep ``state`` (every rank gets rank 0's) for :meth:`start`, which restores it."""
        missing = [k for k in ("step", "history", "adapter", "optimizer") if k not in state]
        if missing:
            raise ValueError(f"DistillSparse checkpoint state lacks {missing}")
        self._resume = {**state, "optimizer": _rank_entry(state["optimizer"])}
