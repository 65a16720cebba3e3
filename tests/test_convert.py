"""`m3jax convert` / `export` / `inspect`: loading converted checkpoints, bit-exact round trips, streaming pieces,
atomic output, and errors that name the file and tensor."""

import collections
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import m3jax
from conftest import FIXTURES
from m3jax import cli
from m3jax.checkpoint import converted, fsutil, orbax_io
from m3jax.checkpoint.convert import convert
from m3jax.checkpoint.export import export
from m3jax.checkpoint.inspect import COMPONENTS, inspect_checkpoint
from m3jax.checkpoint.loader import plan_text_load
from m3jax.checkpoint.mapping import text_rules
from m3jax.checkpoint.pieces import split_rule
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.checkpoint.source import TensorSource
from m3jax.checkpoint.writer import write_checkpoint

FLAT_B16 = FIXTURES / "flat_b16" / "checkpoint"
AUX = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}", "chat_template.jinja": "{{ messages }}",
       "generation_config.json": '{"do_sample": false}', "special_tokens_map.json": "{}", "merges.txt": "a b\n"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def params(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
  pa, pb = params(a), params(b)
  assert pa.keys() == pb.keys()
  for k in pa:
    assert pa[k].dtype == pb[k].dtype, k
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.fixture(scope="module")
def tiny_model():
  return m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  """flat_b16 (original layout, 3 shards, vision + one MTP tensor) plus tokenizer / template side files."""
  d = tmp_path_factory.mktemp("src") / "ckpt"
  shutil.copytree(FLAT_B16, d)
  for name, text in AUX.items():
    (d / name).write_text(text)
  return d


@pytest.fixture(scope="module")
def dst(src, tmp_path_factory):
  out = tmp_path_factory.mktemp("dst") / "m3"
  convert(src, out, progress=False)
  return out


def test_converted_checkpoint_loads_like_the_source(src, dst):
  marker = converted.read_marker(dst)
  assert marker["dtype"] == "float32" and marker["source"]["layout"] == "original"
  assert m3jax.M3Config.from_file(dst) == m3jax.M3Config.from_file(src)
  assert json.loads((dst / "config.json").read_text()) == m3jax.M3Config.from_file(src).to_dict()
  for name, text in AUX.items():
    assert (dst / name).read_text() == text
  assert marker["skipped"] == {} and list(marker["extras"]["mtp"]) == ["layers.0.enorm.weight"]
  model = m3jax.load(dst, kernels="reference")
  assert model.vision is not None
  assert model.dtype == jnp.float32 and model.layers[0].mlp.router[...].dtype == jnp.float32
  assert_same_params(model, m3jax.load(src))
  # Restoring in another dtype (TensorStore cast) rounds exactly like loading the safetensors in that dtype.
  assert_same_params(m3jax.load(dst, dtype="bfloat16"), m3jax.load(src, dtype="bfloat16"))
  ref = np.load(FIXTURES / "flat_b16" / "reference.npz")
  logits = np.asarray(model(ref["input_ids"]))
  assert np.max(np.abs(logits - ref["logits"])) / np.max(np.abs(ref["logits"])) <= 1e-4


def test_orbax_state_is_a_plain_orbax_checkpoint_with_an_mtp_subtree(src, dst):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  tree = ocp.PyTreeCheckpointer().restore(str(dst / converted.STATE))
  assert set(tree) == {"model", "mtp"}
  mtp = load_file(str(src / "model-00003-of-00003.safetensors"))["language_model.model.mtp.layers.0.enorm.weight"]
  np.testing.assert_array_equal(tree["mtp"]["layers"]["0"]["enorm"]["weight"], mtp)
  np.testing.assert_array_equal(converted.read_extras(dst)["layers.0.enorm.weight"], mtp)
  gate_up = tree["model"]["layers"]["1"]["mlp"]["w_gate_up"]
  w1 = load_file(str(src / "model-00001-of-00003.safetensors"))["language_model.model.layers.1.block_sparse_moe.experts.2.w1.weight"]
  np.testing.assert_array_equal(gate_up[2, :, :32], w1.T)


@pytest.mark.quick
def test_hf_layout_source_to_bf16(tmp_path, tiny_model):
  write_checkpoint(tiny_model, tmp_path / "hf", layout="hf", max_shard_bytes=200_000)
  summary = convert(tmp_path / "hf", tmp_path / "out", dtype="bfloat16", progress=False)
  assert summary.layout == "hf" and summary.dtype == "bfloat16"
  loaded = m3jax.load(tmp_path / "out")
  assert loaded.dtype == jnp.bfloat16 and loaded.layers[1].mlp.router[...].dtype == jnp.float32
  assert_same_params(loaded, m3jax.load(tmp_path / "hf", dtype="bfloat16"))
  # --layout forces the naming: original names are then missing.
  with pytest.raises(CheckpointError, match=r"missing tensor 'language_model\.model\.embed_tokens\.weight'"):
    convert(tmp_path / "hf", tmp_path / "out2", layout="original", progress=False)


@pytest.mark.quick
def test_export_is_bit_exact_and_convert_export_convert_round_trips(src, dst, tmp_path):
  summary = export(dst, tmp_path / "exp", max_shard_bytes=100_000, progress=False)
  assert summary.shards > 1
  exported, original = TensorSource.open(tmp_path / "exp"), TensorSource.open(src)
  assert sorted(exported.keys()) == sorted(original.keys())  # text, vision tower + projector, MTP
  for name in original.keys():
    a, b = exported.get(name), original.get(name)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert a.tobytes() == b.tobytes(), name
  for name in AUX:
    assert (tmp_path / "exp" / name).exists()
  again = tmp_path / "again"
  convert(tmp_path / "exp", again, progress=False)
  assert_same_states(dst, again)


def assert_same_states(a, b):
  meta_a, meta_b = orbax_io.leaf_metadata(str(a / converted.STATE)), orbax_io.leaf_metadata(str(b / converted.STATE))
  assert meta_a == meta_b
  ra, rb = orbax_io.SliceReader(str(a / converted.STATE)), orbax_io.SliceReader(str(b / converted.STATE))
  for key in meta_a:
    assert ra.read(key).tobytes() == rb.read(key).tobytes(), key
  ma, mb = converted.read_marker(a), converted.read_marker(b)
  assert ma["extras"] == mb["extras"] and ma["dtype"] == mb["dtype"]


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_large_parameters_stream_in_pieces(tmp_path, tiny_model, layout):
  write_checkpoint(tiny_model, tmp_path / "src", layout=layout)
  source = TensorSource.open(tmp_path / "src")
  _, rules = plan_text_load(tiny_model.config, source)
  by_path = {r.path: r for r in rules}
  model_params = params(tiny_model)
  cases = {("layers", 1, "mlp", "w_gate_up"): (3 * 64 * 64 * 4, 3),  # [8, 64, 64]: 3 experts per piece
           ("layers", 3, "mlp", "w_down"): (2 * 32 * 64 * 4, 4),  # [8, 32, 64]
           ("embed",): (40_000, 4),  # [512, 64]: 156 rows per piece
           ("lm_head",): (40_000, 4)}  # [64, 512]: 156 columns (= source rows) per piece
  for path, (max_bytes, n_pieces) in cases.items():
    rule, full = by_path[path], model_params[path]
    pieces = split_rule(rule, full.shape, 4, max_bytes)
    assert len(pieces) == n_pieces, path
    built = np.full_like(full, np.nan)
    for p in pieces:
      built[p.index] = p.build(source)
    np.testing.assert_array_equal(built, full)
    rebuilt = collections.defaultdict(list)  # whole tensors, or leading-axis row ranges of them, in order
    for p in pieces:
      for name, arr in zip(p.names, p.split(full[p.index]), strict=True):
        rebuilt[name].append(arr)
    for name, arr in zip(rule.sources, rule.from_param(full)):
      np.testing.assert_array_equal(np.concatenate(rebuilt[name]), arr)
  # A conversion (and an export) with tiny pieces writes the same files as with whole arrays.
  convert(tmp_path / "src", tmp_path / "whole", progress=False)
  convert(tmp_path / "src", tmp_path / "pieces", max_piece_bytes=5000, progress=False)
  assert_same_states(tmp_path / "whole", tmp_path / "pieces")
  if layout == "original":
    export(tmp_path / "pieces", tmp_path / "exp_whole", progress=False)
    export(tmp_path / "pieces", tmp_path / "exp_pieces", max_piece_bytes=5000, progress=False)
    a, b = TensorSource.open(tmp_path / "exp_whole"), TensorSource.open(tmp_path / "exp_pieces")
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(a.get(n).tobytes() == b.get(n).tobytes() for n in a.keys())


def test_cli_convert_inspect_export(src, tmp_path, capsys):
  out = tmp_path / "cli"
  assert cli.main(["convert", str(src), str(out), "--no-progress"]) == 0
  text = capsys.readouterr().out
  assert "82 parameters + 1 mtp tensors" in text and "GB/s" in text
  assert "skipped nothing" in text and "copied chat_template.jinja" in text
  assert cli.main(["convert", str(src), str(out), "--no-progress"]) == 2
  assert "already exists; pass --force" in capsys.readouterr().err
  assert cli.main(["convert", str(src), str(out), "--no-progress", "--force", "--dtype", "bfloat16",
                   "--drop-mtp", "--text-only"]) == 0
  assert "skipped 44 tensors: mtp 1 (e.g. language_model.model.mtp.layers.0.enorm.weight); vision 43" in (
      capsys.readouterr().out)
  assert converted.read_marker(out)["dtype"] == "bfloat16"
  assert m3jax.M3Config.from_file(out).vision is None
  assert not [p for p in os.listdir(tmp_path) if ".m3jax-" in p]  # no temporary siblings left
  assert cli.main(["inspect", str(src)]) == 0
  src_report = capsys.readouterr().out
  assert cli.main(["inspect", str(out)]) == 0
  dst_report = capsys.readouterr().out
  for name in ("embeddings", "attention", "indexer", "routed experts", "shared experts", "router", "norms",
               "lm_head"):
    assert name in src_report and name in dst_report
  assert "F32" in src_report and "BF16" in dst_report and "on disk" in dst_report
  assert "vision" in src_report and "mtp" in src_report
  a, b = inspect_checkpoint(src), inspect_checkpoint(out)
  assert {k: v[0] for k, v in a.params.items() if k != "vision"} == {k: v[0] for k, v in b.params.items()}
  assert set(a.params) <= set(COMPONENTS) and sum(v[0] for v in a.params.values()) == sum(
      int(np.prod(v.shape)) for v in params(m3jax.load(src)).values())
  assert cli.main(["export", str(out), str(tmp_path / "exp"), "--no-progress"]) == 0
  assert "exported" in capsys.readouterr().out
  assert cli.main(["convert", str(src), str(tmp_path / "bar")]) == 0  # tqdm bar on stderr: bytes and tensors
  err = capsys.readouterr().err
  assert "convert:" in err and re.search(r"\d+/83 tensors", err) and "B/s" in err


def test_existing_destination_and_interruption(src, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(CheckpointError, match="already exists; pass --force"):
    convert(src, out, progress=False)
  assert (out / "keep.txt").exists()
  with pytest.raises(CheckpointError, match="outside the input"):
    convert(src, src / "sub", progress=False)
  # An exception mid-way (Ctrl-C while reading the 10th tensor): nothing at DST, no temporary left behind.
  calls = []
  real = TensorSource.get

  def failing(self, name, rows=None):
    calls.append(name)
    if len(calls) == 10:
      raise KeyboardInterrupt
    return real(self, name, rows)

  TensorSource.get = failing
  try:
    with pytest.raises(KeyboardInterrupt):
      convert(src, tmp_path / "interrupted", progress=False)
  finally:
    TensorSource.get = real
  assert not (tmp_path / "interrupted").exists()
  assert sorted(os.listdir(tmp_path)) == ["out"]
  # A killed process (os._exit mid-write): DST absent, the leftover temporary does not load, a rerun works.
  script = f"""
import os, sys
sys.path.insert(0, {REPO!r})
from m3jax.checkpoint.convert import convert
from m3jax.checkpoint.source import TensorSource
real, calls = TensorSource.get, []
def get(self, name, rows=None):
  calls.append(name)
  if len(calls) == 20:
    os._exit(17)
  return real(self, name, rows)
TensorSource.get = get
convert({str(src)!r}, {str(tmp_path / 'killed')!r}, progress=False)
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert proc.returncode == 17, proc.stderr
  assert not (tmp_path / "killed").exists()
  leftovers = [p for p in os.listdir(tmp_path) if p.startswith(".killed.m3jax-tmp-")]
  assert len(leftovers) == 1
  with pytest.raises((CheckpointError, FileNotFoundError)):
    m3jax.load(tmp_path / leftovers[0])
  with pytest.raises(FileNotFoundError):
    m3jax.load(tmp_path / "killed")
  convert(src, tmp_path / "killed", progress=False)
  assert converted.is_converted(tmp_path / "killed")


def _copy_single_file(tmp_path, model, name="ckpt"):
  d = tmp_path / name
  write_checkpoint(model, d)
  return d, d / "model.safetensors"


def _rewrite(path, edit):
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path))


@pytest.mark.quick
def test_conversion_errors_name_file_and_tensor(tmp_path, tiny_model):
  d, f = _copy_single_file(tmp_path, tiny_model)
  name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"
  _rewrite(f, lambda t: t.update({name: t[name].astype(np.int32)}))
  with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*experts\.3\.w2\.weight' has dtype I32"):
    convert(d, tmp_path / "o1", progress=False)
  _rewrite(f, lambda t: t.update({name: np.zeros((64, 30), np.float32)}))
  with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight' has shape \[64, 30\], expected \[64, 32\]"):
    convert(d, tmp_path / "o2", progress=False)
  _rewrite(f, lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match=r"missing tensor '.*experts\.3\.w2\.weight' \(expected shape \[64, 32\]"):
    convert(d, tmp_path / "o3", progress=False)
  d, f = _copy_single_file(tmp_path, tiny_model, "c2")
  _rewrite(f, lambda t: t.update({"language_model.model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor .*self_attn\.extra\.weight"):
    convert(d, tmp_path / "o4", progress=False)
  # Truncated data (header intact): the read names the file and the tensor.
  d, f = _copy_single_file(tmp_path, tiny_model, "c3")
  f.write_bytes(f.read_bytes()[:-1000])
  with pytest.raises(CheckpointError, match=r"model\.safetensors"):
    convert(d, tmp_path / "o5", progress=False)
  assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_converted_checkpoint_that_does_not_match_its_config(dst, tmp_path, monkeypatch):
  bad = tmp_path / "bad"
  shutil.copytree(dst, bad)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["text_config"]["num_local_experts"] = 8
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"parameter 'layers/0/mlp/correction_bias' has shape \[4\], expected \[8\] from config"):
    m3jax.load(bad)
  shutil.rmtree(bad / converted.STATE / "d")
  (bad / "config.json").write_text((dst / "config.json").read_text())
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  for _ in range(5):  # Orbax's own metadata reader left TensorStore callbacks on a closed asyncio loop here
    with pytest.raises(CheckpointError, match=r"unreadable Orbax checkpoint: .*/state: cannot read array 'model\."):
      m3jax.load(bad)
    gc.collect()
  assert not unraisable, [u.exc_value for u in unraisable]
  truncated = tmp_path / "truncated"  # the metadata reads, an array's data does not
  shutil.copytree(dst, truncated)
  data_file = max((truncated / converted.STATE).glob("ocdbt.process_*/d/*"), key=os.path.getsize)
  os.truncate(data_file, 100)
  with pytest.raises(CheckpointError, match=r'/state: cannot restore \(.*ValueError: .* in "model\.[a-z0-9_.]+/c/'):
    m3jax.load(truncated)
  os.remove(bad / converted.MARKER)
  with pytest.raises(CheckpointError, match="incomplete conversion"):
    m3jax.load(bad)
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  shutil.copy(dst / "config.json", pickled / "config.json")
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
  with pytest.raises(CheckpointError, match="pickle"):
    convert(pickled, tmp_path / "o", progress=False)
  assert SafetensorsDir  # (the pickle refusal lives in SafetensorsDir)


def test_param_rules_cover_all_layouts():
  cfg = m3jax.tiny()
  for layout in ("original", "hf", "hf_text"):
    rules = text_rules(cfg.text, layout)
    assert len({r.path for r in rules}) == len(rules)
  assert jax.devices()


# Reliability (#45): --force replaces only m3jax outputs, interrupted runs leave DST absent or complete and their
# temporary directories are cleaned by the next run, and every error is one line.


def test_force_replaces_only_m3jax_outputs_or_empty_directories(src, dst, tmp_path, capsys):
  """#45: `convert SRC ~/models --force` deleted everything in ~/models."""
  home = tmp_path / "models"
  (home / "other-model").mkdir(parents=True)
  (home / "other-model" / "weights.bin").write_text("precious")
  for argv in (["convert", str(src), str(home), "--force"], ["export", str(dst), str(home), "--force"]):
    assert cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"m3jax {argv[0]}: error: {home} is not an m3jax output (no "
                                     "m3jax_checkpoint.json or m3jax_export.json) and not empty") in err
  assert (home / "other-model" / "weights.bin").read_text() == "precious"
  (tmp_path / "empty").mkdir()
  assert cli.main(["convert", str(src), str(tmp_path / "empty"), "--force", "--no-progress"]) == 0
  assert converted.is_converted(tmp_path / "empty")
  assert cli.main(["convert", str(src), str(tmp_path / "empty"), "--force", "--no-progress", "--drop-mtp"]) == 0
  assert converted.read_marker(tmp_path / "empty")["extras"]["mtp"] == {}  # the m3jax output was replaced
  out = tmp_path / "exported"
  for _ in range(2):  # export writes a marker too, so a second export --force replaces the first
    assert cli.main(["export", str(dst), str(out), "--force", "--no-progress"]) == 0
  assert json.loads((out / "m3jax_export.json").read_text())["format"] == "m3jax-export"
  assert fsutil.CONVERTED_MARKER == converted.MARKER
  write_checkpoint(m3jax.M3ForCausalLM(m3jax.tiny(), rngs=nnx.Rngs(0)), tmp_path / "written")
  assert fsutil.is_m3jax_output(str(tmp_path / "written"))
  capsys.readouterr()
  link = tmp_path / "link"
  link.symlink_to(tmp_path / "exported")
  assert cli.main(["export", str(dst), str(link), "--force", "--no-progress"]) == 2
  assert "exists and is a symbolic link; refusing to replace it" in capsys.readouterr().err


def _unwritable(tmp_path):
  """A directory this process cannot create entries in: a read-only one, or (as root, whom permissions do not
  stop) one in sysfs, which refuses new directories to everyone."""
  ro = tmp_path / "read-only"
  ro.mkdir()
  ro.chmod(0o555)
  return ro if not os.access(ro, os.W_OK) else pathlib.Path("/sys")


def test_cli_errors_for_unwritable_outputs_bad_json_and_bad_options_are_one_line(src, dst, tmp_path, capsys):
  """#45: tracebacks for a read-only DST / OUT and malformed config / index JSON; --piece-mb 0 was accepted."""
  parent = _unwritable(tmp_path)
  for argv in (["convert", str(src), str(parent / "dst")], ["export", str(dst), str(parent / "out")]):
    assert cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"m3jax {argv[0]}: error: {parent}/" in err and "cannot write in" in err, err
  bad = tmp_path / "bad"
  shutil.copytree(src, bad)
  config = json.loads((bad / "config.json").read_text())
  for name, text, message in (("config.json", "[1, 2]",
                               "config.json: the config must be a JSON object, got a JSON array"),
                              ("config.json", json.dumps({**config, "text_config": None}),
                               "config key 'text_config': must be a JSON object, got null"),
                              ("config.json", "{}", "config.json: the config lacks 'vocab_size'"),
                              ("model.safetensors.index.json", "[]", "the index must be a JSON object")):
    original = (bad / name).read_text()
    (bad / name).write_text(text)
    for argv in (["convert", str(bad), str(tmp_path / "o"), "--no-progress"], ["inspect", str(bad)],
                 ["generate", str(bad), "--prompt-ids", "1,2"]):
      assert cli.main(argv) == 2
      err = capsys.readouterr().err
      assert err.count("\n") == 1 and message in err and f"m3jax {argv[0]}: error: " in err, (argv, err)
    (bad / name).write_text(original)
  assert cli.main(["convert", str(src), str(tmp_path / "o"), "--piece-mb", "0"]) == 2
  assert "--piece-mb must be >= 1 (MiB), got 0" in capsys.readouterr().err
  assert cli.main(["export", str(dst), str(tmp_path / "o"), "--max-shard-mb", "0"]) == 2
  assert "--max-shard-mb must be >= 1 (MiB), got 0" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("signum, at", [(signal.SIGINT, 1), (signal.SIGINT, 60), (signal.SIGTERM, 104)])
def test_ctrl_c_and_sigterm_during_convert_clean_up_without_a_traceback(src, tmp_path, capsys, monkeypatch,
                                                                        signum, at):
  """#45: Ctrl-C during convert printed a traceback. The signal is sent to this process at the `at`-th tensor
  read (of 105): the output is removed as for an error, and the error is one line."""
  real, calls = TensorSource.get, []

  def get(self, name, rows=None):
    calls.append(name)
    if len(calls) == at:
      os.kill(os.getpid(), signum)
    return real(self, name, rows)

  monkeypatch.setattr(TensorSource, "get", get)
  assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
  assert capsys.readouterr().err == f"m3jax convert: error: interrupted ({signal.Signals(signum).name})\n"
  assert os.listdir(tmp_path) == []  # neither DST nor a temporary directory
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the CLI's handler is gone again


def test_interruptions_at_the_edges_of_the_output_directory(src, tmp_path, capsys, monkeypatch):
  """Ctrl-C right after the temporary directory is created leaves nothing; Ctrl-C between moving the previous
  output aside and renaming the new one into place puts the previous output back."""
  real_makedirs, real_rename = os.makedirs, os.rename

  def makedirs(path, *args, **kwargs):
    real_makedirs(path, *args, **kwargs)
    if ".m3jax-tmp-" in str(path):
      os.kill(os.getpid(), signal.SIGINT)

  monkeypatch.setattr(os, "makedirs", makedirs)
  assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
  assert capsys.readouterr().err == "m3jax convert: error: interrupted (SIGINT)\n" and os.listdir(tmp_path) == []
  monkeypatch.setattr(os, "makedirs", real_makedirs)
  assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--no-progress"]) == 0

  def rename(a, b):
    real_rename(a, b)
    if ".m3jax-old-" in str(b):
      raise KeyboardInterrupt

  monkeypatch.setattr(os, "rename", rename)
  assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--force", "--drop-mtp", "--no-progress"]) == 2
  assert os.listdir(tmp_path) == ["dst"] and converted.read_marker(tmp_path / "dst")["extras"]["mtp"]  # the first


_KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from m3jax.checkpoint import fsutil
from m3jax.checkpoint.source import TensorSource
point, calls = {point!r}, []
real_get, real_rename = TensorSource.get, os.rename
def get(self, name, rows=None):
  calls.append(name)
  if point == len(calls):
    os.kill(os.getpid(), signal.SIGKILL)
  return real_get(self, name, rows)
def rename(a, b):
  real_rename(a, b)
  if point == "replacing" and ".m3jax-old-" in str(b):  # the old DST moved aside, the new one not yet in place
    os.kill(os.getpid(), signal.SIGKILL)
TensorSource.get, fsutil.os.rename = get, rename
from m3jax import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _convert_killed(src, dst, point, *extra):
  proc = subprocess.run([sys.executable, "-c", _KILLER.format(repo=REPO, point=point), "convert", str(src), str(dst),
                         "--no-progress", *extra], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == -signal.SIGKILL, proc.stderr
  assert "Traceback" not in proc.stderr


def test_a_killed_conversion_leaves_dst_absent_or_complete_and_a_rerun_cleans_up(src, dst, tmp_path, capsys):
  """Fault injection (#45: interrupted runs left .DST.m3jax-tmp-PID-* directories that reruns neither removed nor
  mentioned). SIGKILL mid-write leaves no DST; SIGKILL while --force replaces an old DST leaves the old one aside;
  Ctrl-C from outside mid-conversion leaves nothing. The next run tidies (and says so), and its result loads."""
  out = tmp_path / "out"
  _convert_killed(src, out, 50)  # the 50th of 105 tensor reads
  assert not out.exists()
  (leftover,) = [p for p in os.listdir(tmp_path) if p.startswith(".out.m3jax-tmp-")]
  assert cli.main(["convert", str(src), str(out), "--no-progress"]) == 0
  err = capsys.readouterr().err
  assert f"[m3jax] removed {tmp_path / leftover}: a temporary directory left by process " in err
  assert "which is no longer running" in err and sorted(os.listdir(tmp_path)) == ["out"]
  assert_same_states(out, dst)
  # Killed between moving the old DST aside and renaming the new one into place: DST is absent; the next run
  # puts the old (complete) DST back before looking at it.
  _convert_killed(src, out, "replacing", "--force", "--drop-mtp")
  assert not out.exists()
  assert sorted(p.split(".m3jax-")[1][:3] for p in os.listdir(tmp_path)) == ["old", "tmp"]  # + the complete new
  assert cli.main(["convert", str(src), str(out), "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert f"[m3jax] restored {out} from " in err and "[m3jax] removed " in err and "already exists; pass --force" in err
  assert sorted(os.listdir(tmp_path)) == ["out"] and converted.read_marker(out)["extras"]["mtp"]  # the old one
  # Ctrl-C from outside once the conversion has started writing.
  # `python -m m3jax.cli convert ...`, with Python's own SIGINT handler even where the test runner ignores SIGINT
  # (a background job of a script), which the child would inherit.
  run_cli = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'm3jax'; runpy.run_module('m3jax.cli', run_name='__main__')")
  proc = subprocess.Popen([sys.executable, "-c", run_cli, "convert", str(src), str(tmp_path / "int"), "--no-progress"],
                          cwd=REPO, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
  deadline = time.monotonic() + 120
  while not [p for p in os.listdir(tmp_path) if p.startswith(".int.m3jax-tmp-")] and proc.poll() is None:
    assert time.monotonic() < deadline
    time.sleep(0.005)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  if proc.returncode == 2:  # interrupted: nothing left
    assert err == "m3jax convert: error: interrupted (SIGINT)\n", err
    assert sorted(os.listdir(tmp_path)) == ["out"]
  else:  # it had finished first: a complete DST
    assert proc.returncode == 0, err
    assert sorted(os.listdir(tmp_path)) == ["int", "out"] and converted.is_converted(tmp_path / "int")
