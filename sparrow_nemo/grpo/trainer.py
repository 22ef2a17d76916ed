"""The GRPO trainer with sparse rollouts: one RL step = one page of phases over a :class:`StepBatch`.

Boundaries (NeMo-RL): the algorithm lives here; generation goes through a
:class:`~sparrow_nemo.rollout.engine.RolloutEngine`; the policy worker is
:class:`~sparrow_nemo.policy.policy.MegatronPolicy`. Process model (:mod:`sparrow_nemo.grpo.process_model`):
every rank holds a policy shard and a rollout engine on the same device (its own, or its shard of a
tensor-parallel engine whose ranks make every call together) and generates its engine's share of the step.
Per step (:meth:`GrpoTrainer.step`), each phase timed as ``timing/<phase>``:

1. ``rollout``: this rank's engine samples its prompts' groups (continuous batching within its KV pool;
   refill rounds with ``grpo.dynamic_sampling``, :mod:`sparrow_nemo.grpo.dynamic_sampling`), then sleeps
   (weights and KV pool released); ``reward``: rewards and group advantages there;
2. ``exchange``: the replica's samples on every rank of its model-parallel group -> the :class:`StepBatch`;
3. ``logprobs`` / ``reference``: dense logprobs, entropy and top-K (and the KL reference's) of the replica's
   rows only; ``stats``: acceptance rate of each rank's own tokens, then the step's statistics and the tail per
   bin merged over all ranks (:func:`~sparrow_nemo.grpo.step_batch.measure`) -> :class:`StepReport`;
4. ``update``: ``grpo.mini_batches_per_step`` optimizer steps of the step-normalised policy loss on the
   replica's rows (:mod:`sparrow_nemo.grpo.update`); a mini-batch whose loss or gradient is
   not finite changes nothing, is logged and counted (``train/skipped_nonfinite``), and
   ``trainer.max_consecutive_nonfinite`` of them in a row abort the run;
5. ``refit``: the engine wakes and takes the policy's weights (:mod:`sparrow_nemo.policy.refit`); ``distill``:
   the DistillSparse phase when ``distill.enabled`` (:mod:`sparrow_nemo.grpo.distill`);
6. the Sparrow controller (:mod:`sparrow_nemo.control`, ``control.*``) decides the next schedule; user callbacks' hooks;
7. ``checkpoint`` every ``checkpoint.every_n_steps`` steps or ``checkpoint.every_n_minutes`` minutes;
   the step's row (JSONL, TensorBoard) with ``timing/step``.

Resume and preemption: the constructor restores the newest usable checkpoint (``checkpoint.resume``;
:mod:`sparrow_nemo.grpo.checkpoint`). SIGTERM / SIGUSR1 (:mod:`sparrow_nemo.grpo.preemption`) are agreed
between steps, between the phases before the update and between decode steps of the rollout: a stop inside a
step abandons it (its prompts are drawn again on resume), checkpoints the last completed step, raises :class:`Preempted`.
All run state is in :class:`TrainerState`; rank 0 writes the files.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.callbacks import CallbackList, instantiate_callbacks
from sparrow_nemo.checkpoint.run_state import prune_checkpoints, resume_candidates, write_run_state
from sparrow_nemo.control import STEP_REPORT, StepReport
from sparrow_nemo.control.callback import OUTPUT_SUBDIR
from sparrow_nemo.grpo import setup, world
from sparrow_nemo.grpo.advantages import compute_advantages
from sparrow_nemo.grpo.checkpoint import TrainerState, load_run_checkpoint
from sparrow_nemo.grpo.distill import STATE_KEY as DISTILL_KEY
from sparrow_nemo.grpo.distill import DistillData, DistillSparse, Probe
from sparrow_nemo.grpo.dynamic_sampling import fill_step, round_seed
from sparrow_nemo.grpo.evaluation import end_evaluation_order, evaluate
from sparrow_nemo.grpo.preemption import Preempted, PreemptionGuard
from sparrow_nemo.grpo.process_model import RankPlan, broadcast_object, gather_objects, reduce_max
from sparrow_nemo.grpo.prompt_source import PromptItem
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import SparrowConfig
from sparrow_nemo.grpo.rollout_step import reference_logprobs
from sparrow_nemo.grpo.step_batch import LocalRollout, StepBatch, generate, measure, score
from sparrow_nemo.grpo.timing import PhaseTimer
from sparrow_nemo.grpo.update import UpdateBatch, UpdateResult, mini_batch_order, update_policy
from sparrow_nemo.policy.packing import concat_outputs, micro_batches
from sparrow_nemo.rollout.engine import RolloutEngine
from sparrow_nemo.rollout.tools.cost_fit import COST_HARDWARE_FILE, rollout_cost_model
from sparrow_nemo.run_io.metric_names import repeat_tag
from sparrow_nemo.run_io.metrics import MetricsWriter, merge_metrics
from sparrow_nemo.run_io.progress import progress, rollout_progress
from sparrow_nemo.run_io.rundir import check_run_dir, make_run_dir
from sparrow_nemo.run_io.wandb_logger import open_wandb
from sparrow_nemo.sparse.mismatch import tail_name
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

#: checkpoint key of the controller's state (the tail scheduler's former class name: older checkpoints load)
SCHEDULER_KEY = "TailMismatchScheduler"
#: checkpoint key of the speculative planner's state (beside the callbacks')
PLANNER_KEY = "SpeculativePlanner"


class NonFiniteTrainingError(RuntimeError):
    """``trainer.max_consecutive_nonfinite`` RL steps in a row skipped their update (NaN/inf loss or gradient)."""


class _StopRequested(Exception):
    """A stop signal was agreed between two phases of a step (internal: the step is abandoned)."""


class GrpoTrainer:
    """GRPO over a recipe; implements the callbacks' ``TrainerLike``.

    Args:
        config: the resolved recipe.
        run_dir: output folder; None = ``logging.run_dir/<name>-<timestamp>`` (``runs/`` when unset). An
            existing folder of another recipe (``config_hash.txt``) is refused unless
            ``checkpoint.force_resume``; with ``checkpoint.resume=auto`` its newest good checkpoint is resumed.
        hf_dir: the HF folder the policy starts from (:func:`train` passes the warm-start's,
            :func:`~sparrow_nemo.grpo.start.start_checkpoint`); None = ``model.hf_checkpoint``, else random init.
    """

    def __init__(
        self, config: SparrowConfig, run_dir: str | Path | None = None, hf_dir: str | Path | None = None
    ) -> None:
        self.config = config
        self.is_main = world.rank() == 0
        if run_dir is not None:
            check_run_dir(config, run_dir)  # before anything is built or written
        user_callbacks = instantiate_callbacks(config.callbacks)  # a bad entry fails before any work
        clash = {SCHEDULER_KEY, DISTILL_KEY} & set(user_callbacks.state_keys())
        if clash:
            raise ValueError(
                f"callbacks: a user callback is named like a built-in component: {sorted(clash)}"
            )
        self.show_progress = config.logging.progress_bar and self.is_main
        self.prompts = build_prompt_source(config)
        hf_dir = config.model.hf_checkpoint if hf_dir is None else str(hf_dir)
        torch.manual_seed(config.trainer.seed)  # the same start whether or not the warm-start was cached
        self.policy = setup.build_policy(config, hf_dir)
        self.plan = RankPlan.current(config.rollout.tensor_parallel_size)
        try:
            self._check_batch_split()
        except ValueError:
            self.policy.close()  # refused before any work: no process group left behind
            raise
        if config.grpo.loss.kl_coef > 0:  # the KL penalty's reference: the initial weights (NeMo-RL style)
            self.policy.keep_reference()
        self.run_dir = Path(broadcast_object(str(make_run_dir(config, run_dir)) if self.is_main else None))
        engine = setup.trainer_engine(config, self.policy, self.plan, self.prompts.tokenizer)  # collective
        # rank 0's engine prices decode steps (CPU: fitted in ~1-2 s on its timed steps, in which every rank of a
        # tensor-parallel engine takes part; kept in the run folder for a resume)
        saved = self.run_dir / COST_HARDWARE_FILE
        self.cost_model = broadcast_object(
            rollout_cost_model(
                config.rollout, config.sparsity, config.model.shape(), engine, saved, write=self.is_main
            )
            if self.plan.in_first_engine
            else None
        )
        self.rollout_engine = setup.rollout_mode_engine(config, engine, self.cost_model)
        self.speculative_engine = setup.speculative_evaluation_engine(config, engine, self.cost_model)
        self.lockstep = setup.lockstep_group(engine)  # the ranks a stop inside the rollout is agreed with
        self.sampling = setup.sampling_params(config)
        schedule = config.sparsity.build_schedule()
        if schedule.is_dense:  # the preset's pages and bins are nominal: use the engine's and the recipe's
            schedule = BudgetSchedule.dense(config.sparsity.bin_tokens, config.sparsity.page_size)
        self.state = TrainerState(step=0, schedule=schedule, initial_schedule=schedule, warm_start_dir=hf_dir)
        self.control = setup.controller(  # the Sparrow controller (None when the run neither adapts nor is sparse)
            config, schedule, self.rollout_engine, self.calibration_prompts, self.sampling, self.plan.in_first_engine,
            self.run_dir / OUTPUT_SUBDIR if self.is_main else None, self.log,
        )  # fmt: skip
        self.distill = self._distill()
        self.callbacks = CallbackList(
            [c for c in user_callbacks if self.is_main or c.collective]
        )  # user extras: rank 0, plus the collective ones everywhere
        self._has_user_callbacks = len(user_callbacks) > 0  # the same on every rank
        self.metrics = MetricsWriter(
            self.run_dir,
            config.logging.jsonl,
            config.logging.tensorboard and self.is_main,
            open_wandb(config.logging.wandb, self.run_dir, config.to_dict()) if self.is_main else None,
            config.logging.metric_aliases,
        )
        self.loss_config = config.grpo.loss
        self._logged: dict[str, float] = {}
        self._nonfinite_streak = 0  # steps in a row whose update was skipped for a NaN/inf loss or gradient
        self.preemption = PreemptionGuard()
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint written
        self._last_save = time.monotonic()
        self._resume()

    def _check_batch_split(self) -> None:
        """Whole prompts per data-parallel rank and per mini-batch, and (without a token budget per
        micro-batch) whole micro-batches of each mini-batch's samples (one-line errors)."""
        g, p, mbs = self.config.grpo, self.config.policy, self.config.policy.micro_batch_size
        rows = len(self.plan.replica_prompts(g.prompts_per_step)) * g.samples_per_prompt
        mini_batch_order(rows, g.samples_per_prompt, g.mini_batches_per_step)
        if p.max_tokens_per_micro_batch is None and (rows // g.mini_batches_per_step) % mbs:
            raise ValueError(
                f"{rows} samples per data-parallel rank (grpo.prompts_per_step={g.prompts_per_step} x "
                f"grpo.samples_per_prompt={g.samples_per_prompt} / {self.plan.dp} ranks) in "
                f"grpo.mini_batches_per_step={g.mini_batches_per_step} mini-batches is not a multiple of "
                f"policy.micro_batch_size={mbs} per mini-batch"
            )

    def _distill(self) -> DistillSparse | None:
        """The DistillSparse phase when ``distill.enabled``."""
        c = self.config
        if not c.distill.enabled:
            return None
        s = c.sparsity
        return DistillSparse(c.distill, c.policy.optimizer.lr, s.pattern(), c.policy.micro_batch_size)

    # ----- TrainerLike ------------------------------------------------------------------------
    @property
    def schedule(self) -> BudgetSchedule:
        return self.state.schedule

    @schedule.setter
    def schedule(self, value: BudgetSchedule) -> None:
        self.state.schedule = value

    def log(self, metrics: dict[str, float]) -> None:
        """Metrics for the current step: a user callback's under ``callbacks/<key>/``, the controller's as named."""
        key = self.callbacks.current
        prefix = "" if key is None else f"callbacks/{key}/"
        self._logged.update({prefix + k: float(v) for k, v in metrics.items()})

    def calibration_prompts(self) -> list[list[int]]:
        """``control.calibration.num_prompts`` held-out prompts x ``samples_per_prompt``."""
        c = self.config.control.calibration
        items = self.prompts.eval_batch(c.num_prompts)
        return [item.prompt_ids for item in items for _ in range(c.samples_per_prompt)]

    # ----- the run ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Run the RL steps up to ``trainer.max_steps``; returns the summary (:mod:`sparrow_nemo.run_io.summary`).

        Raises:
            Preempted: SIGTERM / SIGUSR1 arrived; the run stopped after a checkpoint.
        """
        with self.preemption:
            return self._fit()

    def _start(self) -> None:
        """Built-ins and callbacks' ``on_train_start`` (rank 0's engine may calibrate), then one schedule for all
        ranks."""
        if self.control is not None:  # the start decision: the controller's bins, or the calibration pass
            self.control.on_train_start(self, None)
            self.schedule = self.control.schedule
        if self.distill is not None:
            self.distill.start(self.policy, self.rollout_engine)
        self.callbacks.on_train_start(self)
        self._sync_schedule()
        self._flush(-1, self._logged)  # e.g. the calibration's
        self._logged = {}

    def _fit(self) -> dict[str, Any]:
        from sparrow_nemo.grpo.export import save_run_hf
        from sparrow_nemo.run_io.plots import write_plots
        from sparrow_nemo.run_io.summary import build_summary, write_summary

        cfg = self.config
        self._start()
        if "start" not in self.state.evals:  # a resumed run has both already
            self.state.initial_schedule = self.schedule
            self._evaluate("start", self.schedule)
            self._evaluate("start_dense", self._dense_schedule())
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
                    "step %d: reward %.3f, response length %.1f, %.0f tokens/s, %.1f s",
                    self.state.step,
                    metrics["reward/mean"],
                    metrics["response_length/mean"],
                    metrics["rollout/tokens_per_s"],
                    metrics["timing/step"],
                )
        self._stop_if_signalled()  # a stop during the last step: the next attempt only evaluates
        schedules = {
            "end": self.schedule,
            "end_dense": self._dense_schedule(),
            "end_speculative": self.schedule,
        }
        for tag, pair in end_evaluation_order(
            cfg.evaluation.speed_pairs, self.speculative_engine is not None
        ):
            engine = self.speculative_engine if tag == "end_speculative" else self.rollout_engine
            self._evaluate(repeat_tag(tag, pair), schedules[tag], engine)
        if cfg.checkpoint.enabled and self._saved_step() != self.state.step:
            self.save_checkpoint()
        if cfg.checkpoint.save_hf:  # the final policy as an HF folder, <run_dir>/hf (collective)
            save_run_hf(self.policy, cfg, self.run_dir)
        if self.control is not None:
            self.control.on_train_end(self, None)
        self.callbacks.on_train_end(self)
        summary = build_summary(self.state, self.metrics.history, cfg.sparsity, self.cost_model.hardware.name)
        if self.is_main:
            if cfg.logging.plots:
                write_plots(
                    self.metrics.history,
                    cfg.sparsity.threshold,
                    self.run_dir / "plots",
                    tail_name(cfg.sparsity.quantile),
                    self.metrics.histograms,
                )
            write_summary(summary, self.run_dir)
        self.metrics.close()
        return summary

    def step(self) -> dict[str, float]:
        """One RL step (see the module docstring); returns its metrics (the row written to metrics.jsonl)."""
        cfg, step, timer = self.config, self.state.step, PhaseTimer()
        cursor = self.prompts.cursor
        try:  # one round of rollouts, more with grpo.dynamic_sampling; then the engine sleeps
            draw, g = partial(self._rollout, step, timer), cfg.grpo
            local, sampled = fill_step(draw, g.dynamic_sampling, g.samples_per_prompt, self._advantages)
            with timer.phase("rollout"):
                self.rollout_engine.sleep()
            with timer.phase("exchange"):
                batch = StepBatch.assemble(step, self.schedule, local, self.plan)
            self._stop_between_phases()
            with timer.phase("logprobs"):
                batch.dense = self._dense_logprobs(batch)
            # speculative samples are dense-distributed: the policy is the behaviour policy
            if cfg.rollout.mode == "speculative":
                data = batch.data
                data.rollout_logprobs = torch.where(data.response_mask, batch.dense.logprobs.float(), 0.0)
            if cfg.grpo.loss.kl_coef > 0:
                with timer.phase("reference"):
                    batch.ref_logprobs = reference_logprobs(
                        self.policy, batch.data, cfg.policy.micro_batch_size
                    )
            with timer.phase("stats"):
                batch.stats = measure(batch, cfg.sparsity, self.cost_model, cfg.rollout.max_new_tokens)
                speculative = self._observe_speculative(batch)  # spec/*, then the re-plan
            self._stop_between_phases()
        except _StopRequested:
            self.prompts.cursor = cursor  # the abandoned step's prompts come again after the resume
            self._refit()  # the engine slept (weights released): the unchanged policy fills it again
            self._stop_now()
        self.state.prompt_cursor = self.prompts.cursor
        report = self._report(batch)
        self.callbacks.on_rollout_end(self, report)
        with timer.phase("update"):
            update = self._update(batch)
        train = update.metrics
        with timer.phase("refit"):
            self._refit()
        distilled: dict[str, float] = {}
        if self.distill is not None:
            with timer.phase("distill"):
                distilled = self.distill.run(
                    self.policy, self.rollout_engine, self._distill_data(batch), self.schedule, self._probe()
                )
        if self.control is not None:  # the controller decides on the step's report; the trainer applies it
            self.control.on_train_batch_end(self, None, {STEP_REPORT: report, "metrics": train}, batch, step)
            self.schedule = self.control.schedule
        self.callbacks.on_train_batch_end(self, report, train)
        if self._has_user_callbacks:  # a user callback on rank 0 may have changed the schedule
            self._sync_schedule()
        self.state.step += 1
        row = merge_metrics(
            batch.stats.metrics(batch.schedule, cfg.sparsity.quantile),
            {"timing/rollout_max": batch.stats.rollout_s_max},
            speculative,
            sampled,
            train,
            distilled,
            self._logged,
        )
        self._logged = {}
        with timer.phase("checkpoint"):  # the checkpoint holds the row too (all but its own timing)
            if self._checkpoint_due():
                self.save_checkpoint(pending=(step, row | timer.metrics()))
        metrics = merge_metrics(row, timer.metrics(), {"timing/step": timer.elapsed()})
        self._flush(step, metrics, batch.stats.histograms())
        if self._nonfinite_streak >= cfg.trainer.max_consecutive_nonfinite:
            raise NonFiniteTrainingError(
                f"step {step}: {self._nonfinite_streak} steps in a row skipped for a non-finite loss or gradient "
                f"(trainer.max_consecutive_nonfinite={cfg.trainer.max_consecutive_nonfinite}); aborting"
            )
        return metrics

    # ----- phases -------------------------------------------------------------------------------
    def _rollout(self, step: int, timer: PhaseTimer, round_: int) -> LocalRollout:
        """Rollout round ``round_`` of the step (:func:`fill_step`): the next prompts, this rank's share generated
        (:func:`generate`, seeds of the step and round) and scored; the engine stays awake."""
        if round_ > 0:  # a refill: a stop signal waits for one round at most (collective, as every round is)
            self._stop_between_phases()
        elif self.config.policy.offload_during_rollout:  # back at the update (or a checkpoint) by itself
            self.policy.offload_training_state()
        c, g = self.config, self.config.grpo.samples_per_prompt
        items = self.prompts.next_batch(c.grpo.prompts_per_step)
        sampling = setup.sampling_params(c, round_seed(c.rollout.seed, step, round_), rollouts=True)
        prompts, count = [i.prompt_ids for i in items], len(self.plan.engine_prompts(len(items))) * g
        bar, local = rollout_progress(count, sampling.max_new_tokens, self.show_progress), None
        watch = self.preemption.watch_rollout(bar.update, self.lockstep)  # ends it between decode steps
        with timer.phase("rollout"), bar, watch as on_tokens:
            local = generate(self.rollout_engine, self.plan, prompts, g, sampling, self.schedule, on_tokens)
        self._stop_between_phases()  # a stop inside the rollout abandoned it (local is None): every rank agrees
        with timer.phase("reward"):
            self.score_rollout(local, items)
        return local

    def score_rollout(self, local: LocalRollout, items: list[PromptItem]) -> None:
        """Rewards and group advantages of this rank's samples, where they were generated."""
        answers, g = [items[j].answer for j in self.plan.engine_prompts(len(items))], self.config.grpo
        score(local, answers, self.prompts.train_reward, self._advantages, g.samples_per_prompt)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[n] advantages of [n] rewards grouped by prompt (``grpo.adv_estimator``)."""
        g = self.config.grpo
        options = {"normalize_std": g.normalize_std} if g.adv_estimator == "grpo" else {}
        return compute_advantages(g.adv_estimator, rewards, g.samples_per_prompt, **options)

    def _dense_logprobs(self, batch: StepBatch):
        """Dense log-probs, entropy and top-K of the replica's rows (collective over its model-parallel group);
        K = ``rollout.logprobs_topk``, the rollout's K, so alpha compares lists of one length."""
        data, p = batch.data, self.config.policy
        batches = micro_batches(
            data.tokens, data.lengths, {}, p.micro_batch_size, p.max_tokens_per_micro_batch
        )
        outputs = self.policy.logprobs(batches, top_k=self.config.rollout.logprobs_topk)
        return concat_outputs([o.detach() for o in outputs])

    def _speculative_planner(self):
        """This rank's engine's :class:`~sparrow_nemo.control.speculative.SpeculativePlanner` (None unless
        rollout.mode=speculative)."""
        return getattr(self.rollout_engine, "planner", None)

    def _observe_speculative(self, batch: StepBatch) -> dict[str, float]:
        """rollout.mode=speculative: the ``spec/*`` metrics of rank 0's rollouts; every rank's acceptance goes
        into every planner's table, which re-plans (one plan on all ranks). Collective (a small all-gather)."""
        if self.config.rollout.mode != "speculative":
            return {}
        planner = self._speculative_planner()
        metrics = planner.observe(batch.local.samples, batch.schedule, gather=gather_objects)
        return metrics if self.is_main else {}

    def _report(self, batch: StepBatch) -> StepReport:
        """What the controller and the callbacks see of the step (the same on every rank)."""
        s, stats = self.config.sparsity, batch.stats
        return StepReport(
            step=batch.step,
            schedule=batch.schedule,
            tails=tuple(stats.tails),
            quantile=s.quantile,
            noise_z=s.noise_z,
            reward_mean=stats.reward_mean,
            response_length_mean=stats.length_mean,
            accuracy=stats.accuracy,
        )

    def _update(self, batch: StepBatch) -> UpdateResult:
        """The policy-update phase on this replica's rows (:func:`sparrow_nemo.grpo.update.update_policy`):
        ``grpo.mini_batches_per_step`` optimizer steps of the step-normalised loss."""
        cfg, data = self.config, batch.data
        share = UpdateBatch(
            data.tokens,
            data.lengths,
            data.response_mask,
            data.advantages.float(),
            data.rollout_logprobs,
            batch.dense.logprobs,
            batch.ref_logprobs,
        )
        order = mini_batch_order(len(share), cfg.grpo.samples_per_prompt, cfg.grpo.mini_batches_per_step)
        result = update_policy(
            self.policy,
            share.rows(order),
            self.loss_config,
            cfg.policy.micro_batch_size,
            cfg.grpo.mini_batches_per_step,
            cfg.policy.max_tokens_per_micro_batch,
        )
        if result.skipped is None:
            self._nonfinite_streak = 0
        else:
            if result.skipped != "loss_scale":  # an fp16 overflow is the grad scaler's business, not a fault
                self._nonfinite_streak += 1
            if self.is_main:
                logger.warning("step %d: update skipped, %s", self.state.step, result.skip_detail)
        return result

    def _refit(self) -> None:
        """Wake the engine and stream the policy's weights into it (every rank takes part): the engine's sleep
        released its weights, so the refit runs after every rollout, whether or not the update changed them."""
        self.rollout_engine.wake()
        self.policy.refit(self.rollout_engine)

    def _distill_data(self, batch: StepBatch) -> DistillData:
        return DistillData(batch.data, batch.prompt_lens, batch.kv_budgets, batch.dense.logprobs)

    def _probe(self) -> Probe | None:
        """Rank 0's engine's fixed DistillSparse probe (the calibration prompts, the distill seed): the ranks of
        that engine probe together, rank 0 reports."""
        if not self.plan.in_first_engine:
            return None
        return Probe(
            self.calibration_prompts(), self.sampling, self.config.distill.seed, self.config.sparsity.quantile
        )

    def _evaluate(self, tag: str, schedule: BudgetSchedule, engine: RolloutEngine | None = None) -> None:
        """Sample the held-out prompts once each under ``schedule`` with ``engine`` (default the rollout's), split
        over every engine; stored in the state and passed to the callbacks' ``on_validation_end``. Skipped (on
        every rank alike) when the prompt source has no held-out set: file data without ``data.val_path``."""
        items = self.prompts.eval_batch(self.config.evaluation.num_prompts)
        if not items:
            return
        tally = evaluate(
            engine or self.rollout_engine,
            self.prompts,
            items,
            self.plan.eval_share(len(items)),
            self.sampling,
            schedule,
            count=self.plan.leads_engine,
        )
        result = tally.reduce()
        self.state.evals[tag] = result.to_dict()
        if self.is_main:
            logger.info(
                "eval %s (%s): accuracy %.3f, %.0f tokens/s",
                tag,
                schedule.name,
                result.accuracy,
                result.tokens_per_s,
            )
        numbers = {k: float(v) for k, v in result.to_dict().items() if isinstance(v, int | float)}
        self.callbacks.on_validation_end(self, {f"eval/{tag}/{k}": v for k, v in numbers.items()})

    def _dense_schedule(self) -> BudgetSchedule:
        return BudgetSchedule.dense(self.schedule.bin_tokens, self.schedule.page_size)

    def _sync_schedule(self) -> None:
        """Rank 0's schedule on every rank (after hooks that run only there)."""
        self.schedule = BudgetSchedule.from_dict(broadcast_object(self.schedule.to_dict()))

    def _flush(self, step: int, metrics: dict[str, float], histograms: dict | None = None) -> None:
        """Write one row of ``metrics`` and the step's ``histograms`` (rank 0; nothing when empty)."""
        if self.is_main and metrics:
            self.metrics.write(step, metrics, histograms)

    # ----- checkpoints, resume, preemption --------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        """Folder of the step checkpoints: ``checkpoint.dir`` or ``<run_dir>/checkpoints``."""
        return Path(self.config.checkpoint.dir or self.run_dir / "checkpoints")

    def _checkpoint_due(self) -> bool:
        """Every ``checkpoint.every_n_steps`` steps, or ``every_n_minutes`` after the last save by rank 0's
        clock (agreed by all ranks)."""
        c = self.config.checkpoint
        if not c.enabled:
            return False
        if self.state.step % c.every_n_steps == 0:
            return True
        if c.every_n_minutes <= 0:
            return False
        late = self.is_main and time.monotonic() - self._last_save >= 60.0 * c.every_n_minutes
        return reduce_max([float(late)])[0] > 0

    def save_checkpoint(self, pending: tuple[int, dict[str, float]] | None = None) -> Path:
        """One atomic checkpoint ``step_<n>``: policy shards, optimizer and RNG of every rank, the trainer
        state, the built-ins' and every callback's state; then keep-last-N retention. Collective.

        ``pending``: (step, metrics) of the completed step whose row is written after the checkpoint.
        """
        self.state.prompt_stream = self.prompts.state_dict()
        self.state.metrics_rows = len(self.metrics.history) + (pending is not None)
        self.state.pending_row = None if pending is None else self.metrics.row(*pending)
        with self.preemption.saving():
            states = self.callbacks.on_save_checkpoint(self)  # every rank: collective callbacks gather
            if self.control is not None:
                states[SCHEDULER_KEY] = self.control.state_dict()
            if self.distill is not None:
                distill_state = self.distill.state_dict(self.policy)  # collective
                if distill_state:
                    states[DISTILL_KEY] = distill_state
            planner = self._speculative_planner()
            if self.is_main and planner is not None:
                states[PLANNER_KEY] = planner.state_dict()

            def write_run_files(staging: Path) -> None:
                write_run_state(staging, self.state.to_dict(), states)

            path = self.policy.save(self.checkpoint_root, self.state.step, write_run_files)
            if self.is_main:
                prune_checkpoints(self.checkpoint_root, path, self.config.checkpoint.keep_last)
        self._saved = (self.state.step, path)
        self._last_save = time.monotonic()
        return path

    def _saved_step(self) -> int | None:
        return None if self._saved is None else self._saved[0]

    def _resume(self) -> None:
        """Restore the checkpoint ``checkpoint.resume`` selects, if any; ``metrics.jsonl`` continues after it."""
        candidates = resume_candidates(self.config.checkpoint.resume, self.checkpoint_root)
        loaded = load_run_checkpoint(candidates, self.policy, self.is_main, self.metrics.path)
        if loaded is None:
            if self.is_main:
                self.metrics.keep_rows(0)  # rows of an attempt that never checkpointed are redone
            return
        self.state = TrainerState.from_dict(broadcast_object(loaded.trainer))
        self.prompts.load_state_dict(self.state.prompt_stream)
        states = dict(broadcast_object(loaded.callbacks))  # read on rank 0, needed everywhere
        if self.control is not None and SCHEDULER_KEY in states:
            self.control.load_state_dict(states.pop(SCHEDULER_KEY))
        if self.distill is not None and DISTILL_KEY in states:
            self.distill.load_state_dict(states.pop(DISTILL_KEY))
        planner, planned = self._speculative_planner(), states.pop(PLANNER_KEY, None)
        if planner is not None and planned is not None:  # every engine drafts with the saved plan
            planner.load_state_dict(planned)
        if not self.is_main:  # this rank's callbacks are the collective ones
            keys = set(self.callbacks.state_keys())
            states = {k: v for k, v in states.items() if k in keys}
        self.callbacks.on_load_checkpoint(self, states)
        self.policy.refit(self.rollout_engine)
        if self.is_main:
            self.metrics.keep_rows(self.state.metrics_rows, self.state.pending_row)
            logger.info("resumed from %s: %d steps done", loaded.path, self.state.step)
        self._saved = (self.state.step, loaded.path)

    def _stop_between_phases(self) -> None:
        """Collective, inside a step before the update: raise :class:`_StopRequested` on an agreed stop."""
        if self.preemption.stop_agreed() is not None:
            raise _StopRequested

    def _stop_if_signalled(self) -> None:
        """Collective, between steps: on an agreed stop signal, checkpoint (unless just saved) and raise."""
        if self.preemption.stop_agreed() is not None:
            self._stop_now()

    def _stop_now(self) -> None:
        """Checkpoint the last completed step (unless saved already), close the metrics, raise :class:`Preempted`."""
        signal_name = self.preemption.signal_name or "stop"
        path = None
        if self.config.checkpoint.enabled:
            path = self._saved[1] if self._saved_step() == self.state.step else self.save_checkpoint()
        else:
            logger.warning("%s: checkpoint.enabled=false, stopping without a checkpoint", signal_name)
        self.metrics.close()
        raise Preempted(self.state.step, signal_name, path)
