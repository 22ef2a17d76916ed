"""What a run writes, below the training loop: it knows no trainer, policy or engine.

- :mod:`.rundir`: the run folder (the resolved recipe, its hash, the resume check);
- :mod:`.metrics`: the step metrics' JSON lines, fanned out to :mod:`.tensorboard_logger` and
  :mod:`.wandb_logger`; :mod:`.metric_names`: NeMo-RL / verl aliases and the evaluation tags;
- :mod:`.histograms`: the step histograms' data type and file; :mod:`.plots`: the end-of-run PNG plots;
- :mod:`.summary`: the end-of-run summary (JSON and text); :mod:`.progress`: progress bars (rate and ETA).
"""
