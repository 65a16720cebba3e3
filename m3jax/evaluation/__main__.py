"""``python -m m3jax.evaluation run --model m3jax --model_args pretrained=CKPT --tasks ...``: lm-eval's command
line (``lm-eval``) with the in-process m3jax model registered (m3jax.evaluation.lm_eval_adapter)."""

from __future__ import annotations


def main() -> None:
  from m3jax.evaluation import lm_eval_adapter  # pylint: disable=g-import-not-at-top,unused-import  (registers)
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top

  cli_evaluate()


if __name__ == "__main__":
  main()
