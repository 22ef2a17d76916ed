"""GRPO with sparse rollouts: the algorithm layer.

- :mod:`.trainer`: :class:`~.trainer.GrpoTrainer` (one RL step, readable top to bottom) and :func:`~.trainer.train`;
- :mod:`.advantages`, :mod:`.losses`, :mod:`.objective`: group advantages, policy losses with rollout
  correction, and the policy worker's ``loss_fn``;
- :mod:`.prompts`, :mod:`.data`: prompts, answers and rewards from the synthetic task or a JSONL/Parquet file;
- :mod:`.rollout_step`: rollouts -> padded policy micro-batches and the per-token acceptance rate;
- :mod:`.warmstart`: the cached supervised warm-start; :mod:`.setup`: policy / engine / sampling from a recipe;
- :mod:`.metrics`, :mod:`.evaluation`, :mod:`.summary`, :mod:`.plots`, :mod:`.rundir`: what a run writes.

Modules are imported on demand (``from sparrow_nemo.grpo.losses import ...``) so that the light pieces do not
pull in the heavier ones.
"""
