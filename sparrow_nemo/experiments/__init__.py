"""Toy-scale evidence for the paper's claims (issue 10): arms x seeds of ordinary GRPO runs, then a report.

One job per module:

- :mod:`~sparrow_nemo.experiments.arms`: the arms file (config overrides per arm) and each run's config;
- :mod:`~sparrow_nemo.experiments.runner`: runs every arm x seed in its own folder, resumable;
- :mod:`~sparrow_nemo.experiments.analysis`: reads the run folders, aggregates per arm over seeds;
- :mod:`~sparrow_nemo.experiments.claims`: decides claims (a)-(d) by stated rules;
- :mod:`~sparrow_nemo.experiments.plots` and :mod:`~sparrow_nemo.experiments.report`: figures and markdown;
- :mod:`~sparrow_nemo.experiments.pipeline`: all of it in order (``sparrow experiment``).
"""
