"""The GRPO trainer with sparse rollouts: one RL step = one short function calling the pieces.

Boundaries (NeMo-RL): the algorithm lives here; generation goes through a
:class:`~sparrow_nemo.rollout.engine.RolloutEngine`; the policy worker is
:class:`~sparrow_nemo.policy.policy.MegatronPolicy`. Per step:

1. prompts -> ``engine.generate`` (sparse, ``grpo.samples_per_prompt`` samples per prompt, current schedule;
   the batch is halved and retried on out-of-memory, :mod:`sparrow_nemo.rollout.oom_retry`)
   -> rewards (rank 0; the rollouts are broadcast to the other ranks);
2. group advantages -> padded micro-batches -> dense logprobs, entropy and top-20 from the policy;
3. per-token acceptance rate (policy top-20 vs engine top-20) -> :class:`StepReport` -> callbacks
   (the tail scheduler may change ``self.schedule`` for the next step);
4. policy loss -> one optimizer step -> ``engine.update_weights(policy.export_hf())``; a step whose loss or
   gradient is not finite changes nothing (no update, no refit), is logged and counted
   (``train/skipped_nonfinite``), and ``trainer.max_consecutive_nonfinite`` of them in a row abort the run;
5. metrics (JSONL, TensorBoard), checkpoint every ``checkpoint.every_n_steps`` and at the end.

Resume and preemption: the constructor restores the newest usable checkpoint (``checkpoint.resume``;
:mod:`sparrow_nemo.grpo.checkpointing`); between steps, SIGTERM / SIGUSR1 (:mod:`sparrow_nemo.grpo.preemption`)
stop the run after a checkpoint with :class:`Preempted`.

Process model: every rank builds the policy and runs logprobs / train_step (collectives); only rank 0
holds the rollout engine, runs callbacks and writes files, except that callbacks marked ``collective``
(DistillSparse) run on every rank. All run state is in :class:`TrainerState`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.callbacks import (
    CallbackList,
    TailMismatchScheduler,
    build_step_report,
    instantiate_callbacks,
)
from sparrow_nemo.callbacks.distill_sparse import DistillData
from sparrow_nemo.config import SparrowConfig
from sparrow_nemo.grpo import setup
from sparrow_nemo.grpo.advantages import compute_advantages
from sparrow_nemo.grpo.checkpointing import (
    load_run_checkpoint,
    prune_checkpoints,
    resume_candidates,
    write_run_state,
)
from sparrow_nemo.grpo.evaluation import EvalResult, evaluate
from sparrow_nemo.grpo.metrics import MetricsWriter, progress, rollout_metrics, rollout_progress
from sparrow_nemo.grpo.objective import grpo_loss_fn, policy_loss_config
from sparrow_nemo.grpo.preemption import Preempted, PreemptionGuard
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.rollout_step import (
    collate,
    concat_outputs,
    micro_batches,
    reference_logprobs,
    token_mismatch,
)
from sparrow_nemo.grpo.rundir import check_run_dir, make_run_dir
from sparrow_nemo.grpo.warmstart import ensure_warm_start
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.oom_retry import OomRetryEngine
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.spec_rollout import with_rollout_mode
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

#: checkpoint key of the speculative planner's state (beside the callbacks')
PLANNER_KEY = "SpeculativePlanner"


class NonFiniteTrainingError(RuntimeError):
    """``trainer.max_consecutive_nonfinite`` RL steps in a row skipped their update (NaN/inf loss or gradient)."""


@dataclass
class TrainerState:
    """Everything a resume needs besides the policy checkpoint and the callbacks' states (plain data).

    Attributes:
        step: RL steps completed.
        schedule: the budget schedule the next rollout uses.
        prompt_cursor: position in the prompt stream.
        initial_schedule: the schedule the run started with (for the summary).
        warm_start_dir: the HF checkpoint the policy started from, if any.
        evals: evaluation results by tag ("start", "start_dense", "end", "end_dense").
        prompt_stream: :meth:`PromptSource.state_dict` (cursor, epoch, seed) as of the last checkpoint.
        metrics_rows: rows in ``metrics.jsonl`` as of the last checkpoint (a resumed run drops later ones).
    """

    step: int
    schedule: BudgetSchedule
    prompt_cursor: int = 0
    initial_schedule: BudgetSchedule | None = None
    warm_start_dir: str | None = None
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    prompt_stream: dict[str, Any] = field(default_factory=dict)
    metrics_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "schedule": self.schedule.to_dict(),
            "prompt_cursor": self.prompt_cursor,
            "initial_schedule": None if self.initial_schedule is None else self.initial_schedule.to_dict(),
            "warm_start_dir": self.warm_start_dir,
            "evals": self.evals,
            "prompt_stream": self.prompt_stream,
            "metrics_rows": self.metrics_rows,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        """Inverse of :meth:`to_dict`."""
        initial = data["initial_schedule"]
        return cls(
            step=int(data["step"]),
            schedule=BudgetSchedule.from_dict(data["schedule"]),
            prompt_cursor=int(data["prompt_cursor"]),
            initial_schedule=None if initial is None else BudgetSchedule.from_dict(initial),
            warm_start_dir=data["warm_start_dir"],
            evals=dict(data["evals"]),
            prompt_stream=dict(data["prompt_stream"]),
            metrics_rows=int(data["metrics_rows"]),
        )


class GrpoTrainer:
    """GRPO over a recipe; implements the callbacks' ``TrainerLike`` / ``CalibratingTrainer``.

    Args:
        config: the resolved recipe.
        run_dir: output folder; None = ``logging.run_dir/<name>-<timestamp>`` (``runs/`` when unset). An
            existing folder of another recipe (``config_hash.txt``) is refused unless
            ``checkpoint.force_resume``; with ``checkpoint.resume=auto`` its newest good checkpoint is resumed.
    """

    def __init__(self, config: SparrowConfig, run_dir: str | Path | None = None) -> None:
        self.config = config
        self.is_main = setup.rank() == 0
        if run_dir is not None:
            check_run_dir(config, run_dir)  # before anything is built or written
        self.show_progress = config.logging.progress_bar and self.is_main
        self.prompts = build_prompt_source(config)
        hf_dir = config.model.hf_checkpoint
        if hf_dir is None and config.warmstart.enabled:
            hf_dir = str(ensure_warm_start(config, self.prompts, self.show_progress))
        torch.manual_seed(config.trainer.seed)  # the same start whether or not the warm-start was cached
        self.policy = setup.build_policy(config, hf_dir)
        if config.grpo.loss.kl_coef > 0:  # the KL penalty's reference: the initial weights (NeMo-RL style)
            self.policy.keep_reference()
        self.run_dir = Path(
            setup.broadcast_from_rank0(str(make_run_dir(config, run_dir)) if self.is_main else None)
        )
        weights = self.policy.export_hf()
        self.rollout_engine = (
            OomRetryEngine(
                with_rollout_mode(config, setup.build_engine(config, weights, self.prompts.tokenizer))
            )
            if self.is_main
            else None
        )
        self.sampling = setup.sampling_params(config)
        schedule = config.sparsity.build_schedule()
        if schedule.is_dense:  # the preset's pages and bins are nominal: use the engine's and the recipe's
            schedule = BudgetSchedule.dense(config.sparsity.bin_tokens, config.sparsity.page_size)
        self.state = TrainerState(step=0, schedule=schedule, initial_schedule=schedule, warm_start_dir=hf_dir)
        self.callbacks = self._callbacks()
        self.metrics = MetricsWriter(
            self.run_dir, config.logging.jsonl, config.logging.tensorboard and self.is_main
        )
        self.loss_fn = grpo_loss_fn(policy_loss_config(config.grpo.loss))
        self.distill_data: DistillData | None = None  # the last step's rollouts (see step)
        self.cost_model = DecodeCostModel(
            config.model.shape(), HARDWARE["h200"], dense_layers=config.sparsity.dense_layers
        )
        self._logged: dict[str, float] = {}
        self._nonfinite_streak = 0  # steps in a row whose update was skipped for a NaN/inf loss or gradient
        self.preemption = PreemptionGuard()
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint written
        self._resume()

    # ----- TrainerLike ------------------------------------------------------------------------
    @property
    def schedule(self) -> BudgetSchedule:
        return self.state.schedule

    @schedule.setter
    def schedule(self, value: BudgetSchedule) -> None:
        self.state.schedule = value

    def log(self, metrics: dict[str, float]) -> None:
        """Callbacks' metrics for the current step (written with the step's own)."""
        self._logged.update(metrics)

    @property
    def calibration_prompts(self) -> list[list[int]]:
        """``sparsity.calibration.num_prompts`` held-out prompts x ``samples_per_prompt`` (CalibratingTrainer)."""
        c = self.config.sparsity.calibration
        items = self.prompts.eval_batch(c.num_prompts)
        return [item.prompt_ids for item in items for _ in range(c.samples_per_prompt)]

    # ----- the run ------------------------------------------------------------------------------
    def _callbacks(self) -> CallbackList:
        """The recipe's callbacks (+ the tail scheduler when the sparsity settings need one) on rank 0; the
        ``collective`` ones alone on the other ranks."""
        callbacks = list(instantiate_callbacks(self.config.callbacks))
        if not self.is_main:
            return CallbackList([c for c in callbacks if c.collective])
        s = self.config.sparsity
        wants_scheduler = s.adapt != "off" or s.calibrate or not self.schedule.is_dense
        if wants_scheduler and not any(isinstance(c, TailMismatchScheduler) for c in callbacks):
            callbacks.insert(0, TailMismatchScheduler.from_sparsity(s))
        return CallbackList(callbacks)

    def fit(self) -> dict[str, Any]:
        """Run the RL steps up to ``trainer.max_steps``; returns the summary (:mod:`sparrow_nemo.grpo.summary`).

        Raises:
            Preempted: SIGTERM / SIGUSR1 arrived; the run stopped between steps after a checkpoint.
        """
        with self.preemption:
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        from sparrow_nemo.grpo.plots import write_plots
        from sparrow_nemo.grpo.summary import build_summary, write_summary

        cfg = self.config
        self.callbacks.on_train_start(self)
        self._flush_logged(step=-1)
        if "start" not in self.state.evals:  # a resumed run has both already
            self.state.initial_schedule = self.schedule
            self._evaluate("start", self.schedule)
            self._evaluate(
                "start_dense", BudgetSchedule.dense(self.schedule.bin_tokens, self.schedule.page_size)
            )
        bar = progress(
            range(self.state.step, cfg.trainer.max_steps),
            enabled=self.show_progress,
            desc="GRPO",
            unit="step",
        )
        for _ in bar:
            self._stop_if_signalled()
            metrics = self.step()
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", tok_s=f"{metrics['rollout/tokens_per_s']:.0f}"
            )
            if not self.show_progress and self.is_main:
                logger.info(
                    "step %d: reward %.3f, response length %.1f, %.0f tokens/s",
                    self.state.step,
                    metrics["reward/mean"],
                    metrics["response_length/mean"],
                    metrics["rollout/tokens_per_s"],
                )
            if cfg.checkpoint.enabled and self.state.step % cfg.checkpoint.every_n_steps == 0:
                self.save_checkpoint()
        self._stop_if_signalled()  # a stop during the last step: the next attempt only evaluates
        self._evaluate("end", self.schedule)
        self._evaluate("end_dense", BudgetSchedule.dense(self.schedule.bin_tokens, self.schedule.page_size))
        if cfg.checkpoint.enabled and self._saved_step() != self.state.step:
            self.save_checkpoint()
        self.callbacks.on_train_end(self)
        summary = build_summary(self.state, self.metrics.history, cfg)
        if self.is_main:
            if cfg.logging.plots:
                write_plots(self.metrics.history, cfg.sparsity.threshold, self.run_dir / "plots")
            write_summary(summary, self.run_dir)
        self.metrics.close()
        return summary

    def step(self) -> dict[str, float]:
        """One RL step (see the module docstring); returns its metrics."""
        cfg, step = self.config, self.state.step
        items = self.prompts.next_batch(cfg.grpo.prompts_per_step)
        self.state.prompt_cursor = self.prompts.cursor
        samples, rewards, tokens_per_s = self._rollout(
            [i.prompt_ids for i in items], [i.answer for i in items], step
        )
        planner = self._speculative_planner()
        speculative = (
            {} if planner is None else planner.observe(samples, self.schedule)
        )  # spec/*, then re-plan
        advantages = compute_advantages(
            cfg.grpo.adv_estimator, rewards, cfg.grpo.samples_per_prompt, **self._adv_options()
        )
        data = collate(samples, advantages.float(), pad_id=0)
        batches = micro_batches(
            data.tokens, data.lengths, {}, cfg.policy.micro_batch_size, cfg.policy.max_tokens_per_micro_batch
        )
        dense = concat_outputs([o.detach() for o in self.policy.logprobs(batches)])
        if cfg.rollout.mode == "speculative":  # dense-distributed samples: the policy is the behaviour policy
            data.rollout_logprobs = torch.where(data.response_mask, dense.logprobs.float(), 0.0)
        mismatch = token_mismatch(samples, dense, data)
        report = build_step_report(step, samples, mismatch, rewards, self.schedule, correct=rewards >= 1.0)
        lengths = [s.response_ids.numel() for s in samples]
        prompt_lens = [s.prompt_ids.numel() for s in samples]
        metrics = rollout_metrics(
            samples,
            rewards,
            mismatch,
            self.schedule,
            cfg.sparsity.quantile,
            tokens_per_s,
            self.cost_model.predicted_speedup(self.schedule, lengths, prompt_lens),
        )
        metrics.update(speculative)
        self.callbacks.on_rollout_end(self, report)
        metrics.update(self._update(data, dense, advantages))
        # DistillSparse's sparse PG term: this step's rollouts, advantages and (pre-update) dense logprobs
        self.distill_data = DistillData(samples, advantages.float(), dense.logprobs)
        self.callbacks.on_train_batch_end(self, report, metrics)
        self.state.step += 1
        self._flush_logged(step, metrics)
        if self._nonfinite_streak >= cfg.trainer.max_consecutive_nonfinite:
            raise NonFiniteTrainingError(
                f"step {step}: {self._nonfinite_streak} steps in a row skipped for a non-finite loss or gradient "
                f"(trainer.max_consecutive_nonfinite={cfg.trainer.max_consecutive_nonfinite}); aborting"
            )
        return metrics

    # ----- pieces -------------------------------------------------------------------------------
    def _adv_options(self) -> dict[str, Any]:
        return (
            {"normalize_std": self.config.grpo.normalize_std}
            if self.config.grpo.adv_estimator == "grpo"
            else {}
        )

    def _rollout(
        self, prompts: list[list[int]], answers: list[Any], step: int
    ) -> tuple[list[RolloutSample], torch.Tensor, float]:
        """Rank 0 samples ``samples_per_prompt`` responses per prompt (grouped) and rewards them; broadcast."""
        payload = None
        if self.is_main:
            n = self.config.grpo.samples_per_prompt
            sampling = setup.sampling_params(self.config, seed=sample_seed(self.config.rollout.seed, step))
            with rollout_progress(len(prompts) * n, sampling.max_new_tokens, self.show_progress) as bar:
                batch = self.rollout_engine.generate(
                    [p for p in prompts for _ in range(n)], sampling, self.schedule, on_tokens=bar.update
                )
            expanded = [a for a in answers for _ in range(n)]
            rewards = [
                self.prompts.reward(s.response_ids.tolist(), a) for s, a in zip(batch.samples, expanded)
            ]
            payload = (batch.samples, torch.tensor(rewards, dtype=torch.float32), batch.tokens_per_second())
        return setup.broadcast_from_rank0(payload)

    def _speculative_planner(self):
        """Rank 0's :class:`~sparrow_nemo.rollout.spec_rollout.SpeculativePlanner` (rollout.mode=speculative)."""
        return getattr(self.rollout_engine, "planner", None) if self.is_main else None

    def _update(self, data, dense, advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step of the policy loss on this DP rank's micro-batches; engine refit."""
        from megatron.core import parallel_state as ps

        extras = {
            "mask": data.response_mask,
            "old_logprobs": dense.logprobs,
            "rollout_logprobs": data.rollout_logprobs,
            "advantages": advantages.float(),
        }
        if self.config.grpo.loss.kl_coef > 0:
            extras["ref_logprobs"] = reference_logprobs(
                self.policy, data, self.config.policy.micro_batch_size
            )
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        p = self.config.policy
        batches = micro_batches(
            data.tokens, data.lengths, extras, p.micro_batch_size, p.max_tokens_per_micro_batch, dp
        )
        if len(batches) % dp:
            raise ValueError(
                f"{len(batches)} micro-batches per step do not split over {dp} data-parallel ranks"
            )
        result = self.policy.train_step(batches[dp_rank::dp], self.loss_fn)
        if result.skipped is None:
            self._nonfinite_streak = 0
            weights = self.policy.export_hf()
            if self.is_main:
                self.rollout_engine.update_weights(weights)
        else:  # weights unchanged: nothing to refit
            if result.skipped != "loss_scale":  # an fp16 overflow is the grad scaler's business, not a fault
                self._nonfinite_streak += 1
            if self.is_main:
                logger.warning("step %d: update skipped, %s", self.state.step, result.skip_detail)
        out = {f"train/{k}": float(v) for k, v in result.metrics.items()}
        out["train/loss"] = result.loss
        out["train/grad_norm"] = result.grad_norm
        out["train/skipped_nonfinite"] = float(result.skipped is not None)
        return out

    def _evaluate(self, tag: str, schedule: BudgetSchedule) -> None:
        """Sample the held-out prompts once each under ``schedule`` (rank 0); stored in the state."""
        if self.is_main:
            items = self.prompts.eval_batch(self.config.evaluation.num_prompts)
            result: EvalResult = evaluate(self.rollout_engine, self.prompts, items, self.sampling, schedule)
            self.state.evals[tag] = result.to_dict()
            logger.info(
                "eval %s (%s): accuracy %.3f, %.0f tokens/s",
                tag,
                schedule.name,
                result.accuracy,
                result.tokens_per_s,
            )
        self.state.evals = setup.broadcast_from_rank0(self.state.evals)

    def _flush_logged(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """Write the step's metrics: callback values first, the trainer's own (rollout-time) values win."""
        if not self.is_main:
            return
        merged = {**self._logged, **(metrics or {})}
        self._logged = {}
        if merged:
            self.metrics.write(step, merged)

    # ----- checkpoints, resume, preemption --------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        """Folder of the step checkpoints: ``checkpoint.dir`` or ``<run_dir>/checkpoints``."""
        return Path(self.config.checkpoint.dir or self.run_dir / "checkpoints")

    def save_checkpoint(self) -> Path:
        """One atomic checkpoint ``step_<n>``: policy shards, optimizer and RNG of every rank, the trainer
        state and every callback's state; then keep-last-N retention. Collective."""
        self.state.prompt_stream = self.prompts.state_dict()
        self.state.metrics_rows = len(self.metrics.history)

        with self.preemption.saving():
            callback_states = self.callbacks.on_save_checkpoint(
                self
            )  # every rank: collective callbacks gather
            if self._speculative_planner() is not None:
                callback_states[PLANNER_KEY] = self._speculative_planner().state_dict()

            def write_run_files(staging: Path) -> None:
                write_run_state(staging, self.state.to_dict(), callback_states)

            path = self.policy.save(self.checkpoint_root, self.state.step, write_run_files)
            if self.is_main:
                prune_checkpoints(self.checkpoint_root, path, self.config.checkpoint.keep_last)
        self._saved = (self.state.step, path)
        return path

    def _saved_step(self) -> int | None:
        return None if self._saved is None else self._saved[0]

    def _resume(self) -> None:
        """Restore the checkpoint ``checkpoint.resume`` selects, if any; ``metrics.jsonl`` continues after it."""
        candidates = resume_candidates(self.config.checkpoint.resume, self.checkpoint_root)
        loaded = load_run_checkpoint(candidates, self.policy, self.is_main)
        if loaded is None:
            if self.is_main:
                self.metrics.keep_rows(0)  # rows of an attempt that never checkpointed are redone
            return
        self.state = TrainerState.from_dict(setup.broadcast_from_rank0(loaded.trainer))
        self.prompts.load_state_dict(self.state.prompt_stream)
        states = setup.broadcast_from_rank0(
            loaded.callbacks
        )  # read on rank 0; collective callbacks run everywhere
        if not self.is_main:  # this rank's callbacks are the collective ones
            keys = set(self.callbacks.state_keys())
            states = {k: v for k, v in states.items() if k in keys}
        planner, planned = self._speculative_planner(), states.pop(PLANNER_KEY, None)
        if planner is not None and planned is not None:
            planner.load_state_dict(planned)
        self.callbacks.on_load_checkpoint(self, states)
        weights = self.policy.export_hf()
        if self.is_main:
            self.metrics.keep_rows(self.state.metrics_rows)
            self.rollout_engine.update_weights(weights)
            logger.info("resumed from %s: %d steps done", loaded.path, self.state.step)
        self._saved = (self.state.step, loaded.path)

    def _stop_if_signalled(self) -> None:
        """Collective, between steps: on an agreed stop signal, checkpoint (unless just saved) and raise."""
        signal_name = self.preemption.stop_agreed()
        if signal_name is None:
            return
        path = None
        if self.config.checkpoint.enabled:
            path = self._saved[1] if self._saved_step() == self.state.step else self.save_checkpoint()
        else:
            logger.warning("%s: checkpoint.enabled=false, stopping without a checkpoint", signal_name)
        self.metrics.close()
        raise Preempted(self.state.step, signal_name, path)


def train(config: SparrowConfig, run_dir: str | Path | None = None) -> tuple[dict[str, Any], Path]:
    """Build the trainer, run it, close the workers; returns (summary, run folder)."""
    setup.start_processes()
    setup.apply_cpu_threads(config)
    trainer = GrpoTrainer(config, run_dir)
    try:
        summary = trainer.fit()
    finally:
        trainer.policy.close()
    return summary, trainer.run_dir
