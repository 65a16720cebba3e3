"""lm-evaluation-harness (pinned in the ``eval`` extra) against m3jax (#49): a loglikelihood multiple-choice task, a
loglikelihood_rolling task and a generate_until task (tests/fixtures/lm_eval: YAML + local JSONL) run

- against ``m3jax serve`` with lm-eval's ``local-completions`` model (the tokenizer through the server's
  /tokenize: ``tokenizer_backend=remote``), with batch size 2 (two prompts per request) and 1, and
- in process with the adapter (m3jax.evaluation.lm_eval_adapter, registered as ``m3jax``),

and each per-sample number equals ``m3jax.score_continuations`` (loglikelihoods) or greedy ``generate`` (texts) on
lm-eval's own tokenization of the documents. lm-eval runs through its Python API (``simple_evaluate``, the
function its command line calls) with ``TaskManager(include_defaults=False)``: its command line indexes the ~10k
YAML files of its built-in tasks first (15-30 s here), which the command line cannot skip; the command itself
(docs/serving.md) is checked to reach lm-eval's parser with the ``m3jax`` model registered."""

import json
import math
import os
import pathlib
import subprocess
import sys

# lm-eval loads the tasks' local JSONL files with Hugging Face datasets, which reads these when imported (below):
# nothing may reach for the Hub (CI has no network).
_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
for _key, _value in _OFFLINE.items():
  os.environ.setdefault(_key, _value)

import lm_eval  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import m3jax  # noqa: E402
from m3jax.generate import generate  # noqa: E402
from served_checkpoint import MODEL_NAME, served_checkpoint  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
TASK_DIR = "tests/fixtures/lm_eval"  # its YAML names the JSONL files relative to the repository root
TASKS = ["m3jax_mc", "m3jax_rolling", "m3jax_gen"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  with served_checkpoint(tmp_path_factory.mktemp("lm_eval")) as s:
    yield s


@pytest.fixture
def offline(monkeypatch):
  """lm-eval in this process runs from the repository root (the task files name their data from there)."""
  monkeypatch.chdir(REPO)


def _docs(name):
  with open(REPO / TASK_DIR / f"{name}.jsonl") as f:
    return [json.loads(line) for line in f]


def _encode_pair(tok, context, continuation):
  """lm-eval's split of a (context, continuation) pair into ids (TemplateLM._encode_pair, restated): trailing
  spaces of the context move to the continuation; the continuation is the whole encoding past the context's."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = tok.encode(context + continuation, add_special_tokens=False).ids
  ctx = tok.encode(context, add_special_tokens=False).ids
  return ctx, whole[len(ctx):]


def _scores(model, pairs):
  """score_continuations over (context, continuation) pairs, two at a time (the adapter's batch: one program)."""
  out = []
  for i in range(0, len(pairs), 2):
    two = (pairs[i:i + 2] * 2)[:2]
    out += m3jax.score_continuations(model, [p for p, _ in two], [c for _, c in two]).logprob.tolist()[
        :len(pairs[i:i + 2])]
  return out


def _expected(served):
  """Per task, what every lm-eval sample must hold: mc / rolling log-likelihoods from score_continuations,
  generate_until texts from greedy generate."""
  model, tok = served["model"], served["tok"]
  docs = _docs("mc")
  pairs = [_encode_pair(tok, d["question"], " " + c) for d in docs for c in d["choices"]]  # target_delimiter " "
  flat = _scores(model, pairs)
  mc = [flat[3 * i:3 * i + 3] for i in range(len(docs))]
  bos = tok.token_to_id("<bos>")  # the rolling windows' first context: tokenizer_info's bos_token
  rolling = _scores(model, [([bos], tok.encode(d["text"], add_special_tokens=False).ids) for d in _docs("text")])
  eos = model.config.text.eos_token_ids
  gen = []
  for doc in _docs("gen"):
    out = generate(model, [tok.encode(doc["question"], add_special_tokens=False).ids], max_new_tokens=8,
                   eos_token_ids=eos)
    ids = out.tokens[0, :out.lengths[0]].tolist()
    gen.append(tok.decode(ids[:-1] if ids[-1] in eos else ids, skip_special_tokens=True).split("\n")[0])
  return {"mc": mc, "rolling": rolling, "gen": gen}


def _check(results, samples, want, how):
  """lm-eval's per-sample responses and aggregate scores against the expected numbers."""
  mc = sorted(samples["m3jax_mc"], key=lambda s: s["doc_id"])
  got = [[float(r[0][0]) for r in s["resps"]] for s in mc]
  np.testing.assert_allclose(got, want["mc"], rtol=1e-5, atol=1e-4, err_msg=how)
  acc = np.mean([int(np.argmax(w)) == d["answer"] for w, d in zip(want["mc"], _docs("mc"))])
  assert results["m3jax_mc"]["acc,none"] == pytest.approx(acc), how
  rolling = sorted(samples["m3jax_rolling"], key=lambda s: s["doc_id"])
  np.testing.assert_allclose([float(s["resps"][0][0]) for s in rolling], want["rolling"], rtol=1e-5, atol=1e-4,
                             err_msg=how)
  nbytes = sum(len(d["text"].encode()) for d in _docs("text"))
  bits = -sum(want["rolling"]) / nbytes / math.log(2)
  assert results["m3jax_rolling"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-5), how
  gen = sorted(samples["m3jax_gen"], key=lambda s: s["doc_id"])
  assert [s["resps"][0][0] for s in gen] == want["gen"], how
  assert results["m3jax_gen"]["exact_match,none"] == np.mean(
      [w == d["answer"] for w, d in zip(want["gen"], _docs("gen"))]), how


@pytest.mark.slow
def test_lm_eval_over_http_and_in_process_give_score_continuations_numbers(served, offline):
  from m3jax.evaluation.lm_eval_adapter import M3JaxLM  # pylint: disable=g-import-not-at-top
  want = _expected(served)
  tasks = TaskManager(include_path=str(REPO / TASK_DIR), include_defaults=False)
  # 1. local-completions, batch size 2 (two prompts per request: lm-eval's --batch_size 2), against the server.
  http = lm_eval.simple_evaluate(model="local-completions", model_args={
      "model": MODEL_NAME, "base_url": served["url"] + "/v1/completions", "tokenizer_backend": "remote",
      "max_length": 256}, tasks=TASKS, task_manager=tasks, batch_size=2, log_samples=True)
  _check(http["results"], http["samples"], want, "local-completions, batch size 2")
  # 2. The same, batch size 1.
  http = lm_eval.simple_evaluate(model="local-completions", model_args={
      "model": MODEL_NAME, "base_url": served["url"] + "/v1/completions", "tokenizer_backend": "remote",
      "max_length": 256}, tasks=TASKS, task_manager=tasks, batch_size=1, log_samples=True)
  _check(http["results"], http["samples"], want, "local-completions, batch size 1")
  # 3. In process: the adapter, on the served model (the engine's shapes, so generation reuses its programs).
  lm = M3JaxLM(model=served["model"], checkpoint=served["ckpt"], max_length=256, batch_size=2, steps_per_call=3)
  local = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tasks, log_samples=True)
  _check(local["results"], local["samples"], want, "the m3jax adapter")


@pytest.mark.quick
def test_the_documented_command_line_reaches_lm_evals_parser_with_m3jax_registered():
  """``python -m m3jax.evaluation run ...`` is lm-eval's own command line, with the ``m3jax`` model registered."""
  code = ("import sys; sys.argv = ['m3jax.evaluation', 'run', '--help']\n"
          "from m3jax.evaluation.__main__ import main\n"
          "try:\n  main()\nexcept SystemExit as e:\n  assert not e.code, e.code\n"
          "from lm_eval.api.registry import get_model\nprint('registered:', get_model('m3jax').__module__)")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **_OFFLINE, "PYTHONPATH": str(REPO)}, check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "--model_args" in run.stdout and "--include_path" in run.stdout
  assert run.stdout.rstrip().endswith("registered: m3jax.evaluation.lm_eval_adapter")


@pytest.mark.quick
def test_the_adapter_is_registered_and_refuses_bad_arguments(served):
  from lm_eval.api.registry import get_model  # pylint: disable=g-import-not-at-top
  from m3jax.evaluation.lm_eval_adapter import M3JaxLM  # pylint: disable=g-import-not-at-top
  assert get_model("m3jax") is M3JaxLM
  with pytest.raises(ValueError, match=r"unknown model_args \['temprature'\]"):
    M3JaxLM(model=served["model"], checkpoint=served["ckpt"], temprature=0)
  with pytest.raises(ValueError, match="batch_size must be an integer"):
    M3JaxLM(model=served["model"], checkpoint=served["ckpt"], batch_size="auto")
  lm = M3JaxLM(model=served["model"], checkpoint=served["ckpt"], max_length=256)
  assert (lm.prefix_token_id, lm.eot_token_id) == (1, 2)  # <bos>, <eos>: what the server's /tokenizer_info names
  assert lm.tok_encode("Hello") == served["tok"].encode("Hello", add_special_tokens=False).ids


def test_long_texts_are_scored_in_the_same_rolling_windows_over_http_and_in_process(served, offline):
  """With max_length 8 each text spans several rolling windows: local-completions and the adapter score the same
  windows, so their log-likelihoods agree, and they differ from scoring each text in one window."""
  from m3jax.evaluation.lm_eval_adapter import M3JaxLM  # pylint: disable=g-import-not-at-top
  tasks = TaskManager(include_path=str(REPO / TASK_DIR), include_defaults=False)
  http = lm_eval.simple_evaluate(model="local-completions", model_args={
      "model": MODEL_NAME, "base_url": served["url"] + "/v1/completions", "tokenizer_backend": "remote",
      "max_length": 8}, tasks=["m3jax_rolling"], task_manager=tasks, batch_size=2, log_samples=True)
  lm = M3JaxLM(model=served["model"], checkpoint=served["ckpt"], max_length=8, batch_size=2)
  local = lm_eval.simple_evaluate(model=lm, tasks=["m3jax_rolling"], task_manager=tasks, log_samples=True)
  got, want = ([float(s["resps"][0][0]) for s in sorted(run["samples"]["m3jax_rolling"], key=lambda s: s["doc_id"])]
               for run in (local, http))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  texts = [served["tok"].encode(d["text"], add_special_tokens=False).ids for d in _docs("text")]
  assert min(len(t) for t in texts) > 7  # several windows each
  whole = _scores(served["model"], [([1], t) for t in texts])  # each text in one window
  assert all(abs(g - w) > 1e-2 for g, w in zip(got, whole))
