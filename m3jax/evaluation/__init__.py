"""Evaluation harness adapters. ``m3jax.evaluation.lm_eval_adapter`` is an lm-evaluation-harness model over m3jax
in process (it needs the optional ``eval`` extra: ``pip install -e .[eval]``); ``python -m m3jax.evaluation`` is
lm-eval's command line with that model registered as ``m3jax``. Importing this package imports no lm-eval."""
