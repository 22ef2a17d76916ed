"""GRPO with sparse rollouts: the algorithm layer.

- :mod:`.trainer`: :class:`~.trainer.GrpoTrainer` (one RL step, readable top to bottom) and :func:`~.trainer.train`;
- :mod:`.advantages`, :mod:`.losses`, :mod:`.objective`: group advantages, policy losses with rollout
  correction, and the policy worker's ``loss_fn``;
- :mod:`.prompts`, :mod:`.data`: prompts, answers and rewards from the synthetic task or a JSONL/Parquet file;
- :mod:`.rollout_step`: rollouts -> padded policy micro-batches and the per-token acceptance rate;
- :mod:`.warmstart`: the cached supervised warm-start (a step of :func:`~.trainer.train`, before the trainer is
  built: :func:`~.start.start_checkpoint`); :mod:`.setup`: policy / engine / sampling from a recipe;
- :mod:`.evaluation`: the held-out evaluations; what a run writes is :mod:`sparrow_nemo.run_io`.

Modules are imported on demand (``from sparrow_nemo.grpo.losses import ...``) so that the light pieces do not
pull in the heavier ones.
"""
