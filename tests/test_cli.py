"""The m3jax CLI end to end: demo (build + stream), generate with ids and text, forward, clear errors."""

import io
import json
import re

import numpy as np
import pytest

from conftest import FIXTURES
import m3jax
from m3jax import cli
from m3jax.demo import build_demo_checkpoint
from m3jax.generate import generate
from m3jax.tokenizer import load_tokenizer, render_chat, render_messages


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
  return build_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny")


@pytest.mark.quick
def test_demo_checkpoint_is_original_layout_with_tokenizer(demo_dir):
  index = json.loads(open(f"{demo_dir}/config.json").read())
  assert index["text_config"]["vocab_size"] == load_tokenizer(demo_dir).get_vocab_size()
  from m3jax.checkpoint.safetensors_dir import SafetensorsDir
  names = SafetensorsDir(demo_dir).keys()
  assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
  assert render_chat(demo_dir, "hi").startswith("<bos><user>hi<assistant>")


def test_demo_command_streams_text(capsys, tmp_path):
  assert cli.main(["demo", "--out", str(tmp_path / "d"), "--max-new-tokens", "8"]) == 0
  out, err = capsys.readouterr()
  assert "wrote a tiny M3 checkpoint" in out
  assert "generated 8" in err and "time to first token" in err and "decode" in err


@pytest.mark.parametrize("extra", [["--steps-per-call", "1"], ["--steps-per-call", "4"], ["--prefill-chunk", "16"]])
def test_generate_with_prompt_ids_matches_the_library(capsys, extra):
  ckpt = FIXTURES / "flat_b16" / "checkpoint"
  ref = np.load(FIXTURES / "flat_b16" / "reference.npz")
  prompt = ref["input_ids"][0, :ref["gen_prompt_lens"][0]].tolist()
  assert cli.main(["generate", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "10",
                   "--kernels", "reference", *extra]) == 0
  out, _ = capsys.readouterr()
  assert [int(t) for t in out.split()] == ref["gen_tokens"][0, :10].tolist()


def test_generate_with_text_and_chat(capsys, demo_dir):
  assert cli.main(["generate", str(demo_dir), "--prompt", "Hello", "--chat", "--max-new-tokens", "5",
                   "--temperature", "0.7", "--top-p", "0.9", "--seed", "1"]) == 0
  _, err = capsys.readouterr()
  ids = load_tokenizer(demo_dir).encode(render_chat(demo_dir, "Hello"), add_special_tokens=False).ids
  specials = [load_tokenizer(demo_dir).token_to_id(t) for t in ("<bos>", "<user>", "<assistant>")]
  assert ids[:2] == specials[:2] and ids[-1] == specials[2]
  assert f"prompt {len(ids)} tokens" in err


def test_generate_reads_a_prompt_file_and_chunks_its_prefill(capsys, demo_dir, tmp_path):
  prompt = tmp_path / "long.txt"
  prompt.write_text("The quick brown fox jumps over the lazy dog. " * 12)
  outputs = []
  for extra in ([], ["--prefill-chunk", "32"]):
    assert cli.main(["generate", str(demo_dir), "--prompt-file", str(prompt), "--max-new-tokens", "6",
                     "--kernels", "reference", *extra]) == 0
    out, err = capsys.readouterr()
    outputs.append(out)
    n = len(load_tokenizer(demo_dir).encode(prompt.read_text(), add_special_tokens=False).ids)
    assert n > 64 and f"prompt {n} tokens" in err  # bucket 128 or more: 4+ chunks of 32
  assert outputs[0] == outputs[1]
  (tmp_path / "empty.txt").write_text("  ")
  assert cli.main(["generate", str(demo_dir), "--prompt-file", str(tmp_path / "empty.txt")]) == 2
  assert "empty.txt: empty prompt" in capsys.readouterr().err


@pytest.mark.quick
def test_cli_errors_are_one_clear_line(capsys, tmp_path):
  assert cli.main(["generate", str(tmp_path), "--prompt-ids", "1"]) == 2
  assert "no config.json" in capsys.readouterr().err
  ckpt = FIXTURES / "flat_b16" / "checkpoint"
  assert cli.main(["generate", str(ckpt), "--prompt", "hi"]) == 2
  assert "no tokenizer.json" in capsys.readouterr().err
  assert cli.main(["forward", str(ckpt), "--prompt-ids", "1,2,9999"]) == 2
  assert "outside [0, 256)" in capsys.readouterr().err
  assert cli.main(["generate", str(ckpt), "--prompt-ids", "1,2", "--prefill-chunk", "100"]) == 2
  assert "prefill_chunk must be a power of two >= 16, got 100" in capsys.readouterr().err


def test_generate_with_images(capsys, demo_dir, tmp_path):
  from PIL import Image
  paths = []
  for i, size in enumerate([(60, 90), (40, 40)]):
    path = tmp_path / f"img{i}.png"
    Image.fromarray((np.random.default_rng(i).random((*size, 3)) * 255).astype("uint8")).save(path)
    paths += ["--image", str(path)]
  assert cli.main(["generate", str(demo_dir), "--prompt", "Describe.", "--chat", "--max-new-tokens", "3",
                   *paths]) == 0
  err = capsys.readouterr().err
  assert "2 image(s): grids [[1, 4, 6], [1, 4, 4]]" in err  # 40x40 is upscaled to 56x56 (min_pixels) and "generated 3" in err
  assert cli.main(["generate", str(demo_dir), "--prompt", "x", "--image", str(tmp_path / "missing.png")]) == 2
  assert "missing.png" in capsys.readouterr().err


def test_forward_reports_and_saves_selections(capsys, demo_dir, tmp_path):
  prompt = tmp_path / "prompt.txt"
  prompt.write_text("The quick brown fox jumps over the lazy dog. " * 8)
  saved = tmp_path / "sel.npz"
  assert cli.main(["forward", str(demo_dir), "--prompt-file", str(prompt), "--selection-stats",
                   "--save-selections", str(saved), "--kernels", "reference"]) == 0
  out = capsys.readouterr().out
  data = np.load(saved)
  layers = sorted(n for n in data.files if n.startswith("layer_"))
  assert layers and all(f"  {name}: selected " in out for name in layers)
  length = data["positions"].shape[1]
  assert f"{length} tokens" in out and length == len(load_tokenizer(demo_dir).encode(prompt.read_text()).ids)
  assert all(data[name].shape[:2] == (1, length) and data[name].dtype == np.int32 for name in layers)
  assert cli.main(["forward", str(demo_dir), "--prompt-file", str(prompt), "--prompt-ids", "1"]) == 2
  assert "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_speculative_streams_the_library_tokens(capsys, demo_dir, tmp_path):
  """--speculative K (with and without an image) prints generate_speculative's tokens and its acceptance."""
  import m3jax
  from PIL import Image
  from m3jax.commands.generate import _multimodal_prompt
  from m3jax.speculative import generate_speculative
  from m3jax.tokenizer import generation_eos_ids
  from m3jax.vision import IMAGE_MARKER
  path = tmp_path / "img.png"
  Image.fromarray((np.random.default_rng(3).random((40, 60, 3)) * 255).astype("uint8")).save(path)
  tok = load_tokenizer(demo_dir)
  model = m3jax.load(demo_dir, with_mtp=True)
  text = render_chat(demo_dir, "Describe.")
  for images in ([], [str(path)]):
    assert cli.main(["generate", str(demo_dir), "--prompt", "Describe.", "--chat", "--max-new-tokens", "12",
                     "--speculative", "2", "--steps-per-call", "2", *sum((["--image", p] for p in images), [])]) == 0
    out, err = capsys.readouterr()
    if images:
      ids, embeds = _multimodal_prompt(model, tok, render_chat(demo_dir, IMAGE_MARKER + "Describe."), images)
    else:
      ids, embeds = tok.encode(text, add_special_tokens=False).ids, None
    eos = tuple(dict.fromkeys(model.config.text.eos_token_ids + generation_eos_ids(demo_dir)))
    ref = generate_speculative(model, [ids], max_new_tokens=12, num_draft_tokens=2, eos_token_ids=eos,
                               prompt_embeds=embeds)
    assert out.rstrip("\n") == tok.decode(ref.tokens[0, : ref.lengths[0]].tolist(), skip_special_tokens=False)
    assert f"generated {ref.lengths[0]} in {ref.rounds[0]} verification rounds of 2 drafts" in err
    assert f"acceptance {ref.acceptance_rate:.2f}" in err


@pytest.mark.slow
def test_chat_keeps_its_caches_between_turns(capsys, monkeypatch, demo_dir):
  from m3jax.vision import IMAGE_MARKER  # pylint: disable=g-import-not-at-top
  # The third line holds an image placeholder but no image was attached: that turn is refused and dropped (#45).
  monkeypatch.setattr("sys.stdin", io.StringIO(f"Hello there\n\nLook: {IMAGE_MARKER}\nWhat is sparse attention?\n"
                                               "/reset\nHello there\n"))
  assert cli.main(["chat", str(demo_dir), "--max-new-tokens", "6", "--kernels", "reference", "--system",
                   "Be brief."]) == 0
  out, err = capsys.readouterr()
  replies = out.split("\n")[:3]
  turns = re.findall(r"turn (\d): (\d+) tokens from the cache, (\d+) prefilled, (\d+) generated", err)
  assert [t[0] for t in turns] == ["1", "2", "3"] and "conversation reset" in err
  assert "[m3jax] error: the prompt ids hold image / video placeholder tokens [5] but no image or video was given" in err
  assert "; turn dropped" in err
  tok = load_tokenizer(demo_dir)
  first = render_messages(demo_dir, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello there"}])
  n1 = len(tok.encode(first, add_special_tokens=False).ids)
  assert turns[0][1:3] == ("0", str(n1))
  # Turn 2 renders the whole conversation (turn 1 and its reply): the cache serves at least turn 1's prompt.
  assert int(turns[1][1]) >= n1 and int(turns[1][2]) > 0
  assert turns[2][1:3] == ("0", str(n1)) and replies[2] == replies[0]  # after /reset: turn 1 again, same reply
  # The first reply is the library's greedy completion of turn 1, stop token dropped.
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  eos = model.config.text.eos_token_ids
  lib = generate(model, [tok.encode(first, add_special_tokens=False).ids], max_new_tokens=6, eos_token_ids=eos)
  want = [t for t in lib.tokens[0, :lib.lengths[0]].tolist() if t not in eos]
  assert replies[0] == tok.decode(want, skip_special_tokens=False)


@pytest.mark.quick
def test_chat_needs_a_tokenizer_and_template(capsys, demo_dir, tmp_path):
  ckpt = FIXTURES / "flat_b16" / "checkpoint"
  assert cli.main(["chat", str(ckpt)]) == 2
  assert "no tokenizer.json" in capsys.readouterr().err
  import shutil  # pylint: disable=g-import-not-at-top
  plain = tmp_path / "no_template"
  shutil.copytree(demo_dir, plain)
  (plain / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
  assert cli.main(["chat", str(plain)]) == 2
  assert "chat needs a chat_template in tokenizer_config.json" in capsys.readouterr().err



def test_score_prints_the_library_perplexity(capsys, demo_dir, tmp_path):
  from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

  text = tmp_path / "doc.txt"
  text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
  saved = tmp_path / "lp.npz"
  assert cli.main(["score", str(demo_dir), "--text-file", str(text), "--kernels", "reference", "--prefill-chunk",
                   "32", "--save", str(saved)]) == 0
  out, _ = capsys.readouterr()
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  ids = [model.config.text.bos_token_id] + load_tokenizer(demo_dir).encode(text.read_text(),
                                                                         add_special_tokens=False).ids
  want = token_logprobs(model, [ids])
  assert f"tokens {len(ids)} (scored {len(ids) - 1})" in out
  got = float(re.search(r"perplexity ([\d.]+)", out).group(1))
  assert got == pytest.approx(want.perplexity(), rel=1e-3)
  rec = np.load(saved)
  np.testing.assert_array_equal(rec["ids"], ids)
  np.testing.assert_allclose(rec["logprobs"], want.logprobs[0, :len(ids)], atol=2e-2)  # bf16, chunked vs one shot
  assert cli.main(["score", str(demo_dir), "--prompt-ids", "5"]) == 2
  assert "at least 2 tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_batch_writes_each_prompts_own_completion_in_input_order(capsys, demo_dir, tmp_path):
  tok = load_tokenizer(demo_dir)
  requests = [{"prompt": "What is sparse attention?", "id": "a"}, {"prompt_ids": [7, 8, 9]},
              {"prompt": "A block holds one hundred and twenty-eight keys, and the indexer picks sixteen."},
              {"prompt": "Hi", "id": 4}, {"prompt_ids": list(range(10, 60))}]
  src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text("\n".join(json.dumps(r) for r in requests) + "\n\n")
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--batch-size", "2",
                   "--max-new-tokens", "5", "--kernels", "reference"]) == 0
  assert "5 prompts, " in capsys.readouterr().err
  lines = [json.loads(x) for x in dst.read_text().splitlines()]
  assert [x["index"] for x in lines] == list(range(5)) and [x["id"] for x in lines] == ["a", None, None, 4, None]
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  eos = model.config.text.eos_token_ids
  for r, x in zip(requests, lines):
    ids = r.get("prompt_ids") or tok.encode(r["prompt"], add_special_tokens=False).ids
    alone = generate(model, [ids], max_new_tokens=5, eos_token_ids=eos)
    want = alone.tokens[0, : alone.lengths[0]].tolist()
    assert x["completion_ids"] == want and x["prompt_tokens"] == len(ids)
    assert x["finish_reason"] == ("stop" if want[-1] in eos else "length")
    assert x["completion"] == tok.decode(want[:-1] if want[-1] in eos else want, skip_special_tokens=False)
  # --chat wraps the text prompts in the chat template; id prompts are taken as they are.
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--max-new-tokens", "2",
                   "--chat", "--kernels", "reference"]) == 0
  lines = [json.loads(x) for x in dst.read_text().splitlines()]
  assert lines[0]["prompt_tokens"] == len(tok.encode(render_chat(demo_dir, requests[0]["prompt"]),
                                                     add_special_tokens=False).ids)
  assert lines[1]["prompt_tokens"] == 3


def test_batch_stop_strings_cut_the_completion_and_its_ids(demo_dir, tmp_path):
  tok = load_tokenizer(demo_dir)
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  ids = tok.encode("The quick brown fox", add_special_tokens=False).ids
  alone = generate(model, [ids], max_new_tokens=30, eos_token_ids=model.config.text.eos_token_ids)
  want_ids = alone.tokens[0, : alone.lengths[0]].tolist()
  text = tok.decode(want_ids, skip_special_tokens=False)
  stop = text[len(text) // 2:len(text) // 2 + 2]
  src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text(json.dumps({"prompt_ids": ids, "stop": stop}) + "\n" + json.dumps({"prompt_ids": ids}) + "\n")
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--batch-size", "2",
                   "--max-new-tokens", "30", "--kernels", "reference", "--logprobs"]) == 0
  cut, full = [json.loads(x) for x in dst.read_text().splitlines()]
  assert full["completion_ids"] == want_ids
  scored = m3jax.token_logprobs(model, [ids + want_ids]).logprobs[0, len(ids):len(ids) + len(want_ids)]
  np.testing.assert_allclose(full["completion_logprobs"], scored, atol=2e-2)  # bf16 decode steps vs one forward
  assert cut["completion_logprobs"] == full["completion_logprobs"][:len(cut["completion_ids"])]
  assert cut["finish_reason"] == "stop" and cut["completion"] == text[:text.find(stop)]
  n = len(cut["completion_ids"])  # up to the token that completed the stop string
  assert cut["completion_ids"] == want_ids[:n] and stop in tok.decode(want_ids[:n])
  assert stop not in tok.decode(want_ids[:n - 1])


def test_batch_lines_set_their_own_max_tokens_and_sampling(demo_dir, tmp_path):
  """#49: per-line max_tokens / temperature were silently ignored. A greedy line gets generate's tokens for its own
  budget; a sampled line follows its own seed, whatever line it is on."""
  tok = load_tokenizer(demo_dir)
  greedy = {"prompt": "Hello", "max_tokens": 2, "temperature": None}
  sampled = {"prompt": "What is sparse attention?", "max_tokens": 6, "temperature": 0.9, "top_p": 0.95, "seed": 3,
             "top_k": -1}
  outs = []
  for order in ((greedy, sampled), (sampled, greedy)):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in order))
    assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--batch-size", "2",
                     "--max-new-tokens", "3", "--kernels", "reference"]) == 0
    outs.append([json.loads(x) for x in dst.read_text().splitlines()])
  (g1, s1), (s2, g2) = outs
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  alone = generate(model, [tok.encode("Hello", add_special_tokens=False).ids], max_new_tokens=2,
                   eos_token_ids=model.config.text.eos_token_ids)
  assert g1["completion_ids"] == g2["completion_ids"] == alone.tokens[0, :alone.lengths[0]].tolist()
  assert s1["completion_ids"] == s2["completion_ids"]
  assert len(s1["completion_ids"]) == 6 or s1["finish_reason"] == "stop"
  plain = generate(model, [tok.encode(sampled["prompt"], add_special_tokens=False).ids], max_new_tokens=6,
                   eos_token_ids=model.config.text.eos_token_ids)
  assert s1["completion_ids"] != plain.tokens[0, :plain.lengths[0]].tolist()  # its temperature was used


def test_batch_messages_lines_take_images_as_data_and_file_urls(demo_dir, tmp_path):
  """Chat lines with image parts (a file: URL relative to the input file, the same image as a data: URL) get
  generate's greedy tokens on the rendered ids and embed_multimodal's embeddings; a text chat line too."""
  import base64  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from m3jax.vision import IMAGE_MARKER, build_multimodal_inputs  # pylint: disable=g-import-not-at-top

  (tmp_path / "media").mkdir()
  Image.fromarray((np.random.default_rng(0).random((60, 90, 3)) * 255).astype("uint8")).save(tmp_path / "media/a.png")
  data = "data:image/png;base64," + base64.b64encode((tmp_path / "media/a.png").read_bytes()).decode()
  text = {"type": "text", "text": "Describe."}
  requests = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text]}]}
              for url in ("file:media/a.png", data)] + [{"messages": [{"role": "user", "content": "Describe."}]}]
  src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text("\n".join(json.dumps(r) for r in requests) + "\n")
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--batch-size", "2",
                   "--max-new-tokens", "4", "--kernels", "reference"]) == 0
  lines = [json.loads(x) for x in dst.read_text().splitlines()]
  model, tok = m3jax.load(demo_dir, kernels="reference"), load_tokenizer(demo_dir)
  eos = model.config.text.eos_token_ids
  for content, images, line in ((IMAGE_MARKER + "Describe.", [tmp_path / "media/a.png"], lines[0]),
                                (IMAGE_MARKER + "Describe.", [tmp_path / "media/a.png"], lines[1]),
                                ("Describe.", [], lines[2])):
    rendered = render_messages(demo_dir, [{"role": "user", "content": content}])
    inputs = build_multimodal_inputs(rendered, tok, images=images)
    embeds = model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs()) if images else None
    alone = generate(model, inputs.input_ids.tolist(), max_new_tokens=4, eos_token_ids=eos, prompt_embeds=embeds)
    assert line["completion_ids"] == alone.tokens[0, : alone.lengths[0]].tolist()
    assert line["prompt_tokens"] == inputs.input_ids.shape[1]
  assert lines[0]["prompt_tokens"] == lines[2]["prompt_tokens"] + 8  # start, 6 placeholders (24 patches / 4), end


@pytest.mark.parametrize("line, message", [
    ("not json", "in.jsonl:2:1: not JSON (Expecting value at line 2 column 1)"),
    ('{"prompt": x}', "in.jsonl:2:12: not JSON (Expecting value at line 2 column 12)"),  # the decoder's column
    ('{"prompt": "a", "temperature": -1}', "in.jsonl:2: temperature must be a finite number >= 0, got -1"),
    ('{"prompt": "a", "top_k": 2147483648}', "in.jsonl:2: top_k must be an integer in [-1, 2147483647]"),
    ('{"prompt": "a", "max_tokens": 0}', 'in.jsonl:2: "max_tokens" must be a positive integer, got 0'),
    ('{"prompt": "a", "prompt_ids": [1]}', 'in.jsonl:2: expected an object with one of "prompt"'),
    ('{"prompt_ids": [1, "x"]}', '"prompt_ids" must be a non-empty list of ints'),
    ('{"prompt_ids": [1, 100000]}', "in.jsonl:2: token ids outside [0, "),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"prompt": "a", "stop": [""]}', 'in.jsonl:2: "stop" must be a non-empty string or a list of them'),
    ('{"prompt_ids": [7, 5]}', "in.jsonl:2: the prompt ids hold image / video placeholder tokens [5]"),
    ('{"prompt": "a", "messages": []}', 'in.jsonl:2: expected an object with one of "prompt"'),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a"}}]}]}',
     "in.jsonl:2: messages.[0].content.[0]: image URLs are not fetched"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": '
     '{"url": "file:missing.png"}}]}]}', "in.jsonl:2: messages.[0].content.[1]: no such image file "),
])
@pytest.mark.quick
def test_batch_names_the_bad_line(capsys, demo_dir, tmp_path, line, message):
  src = tmp_path / "in.jsonl"
  src.write_text('{"prompt": "fine"}\n' + line + "\n")
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "o.jsonl").exists()


def test_chat_with_an_image_reuses_the_image_turn(capsys, monkeypatch, demo_dir, tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from m3jax.vision import IMAGE_MARKER, build_multimodal_inputs  # pylint: disable=g-import-not-at-top

  path = tmp_path / "img.png"
  Image.fromarray((np.random.default_rng(0).random((60, 90, 3)) * 255).astype("uint8")).save(path)
  monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {tmp_path / 'missing.png'}\n/image {path}\nDescribe.\n"
                                               "And the colours?\n"))
  assert cli.main(["chat", str(demo_dir), "--max-new-tokens", "4", "--kernels", "reference"]) == 0
  err = capsys.readouterr().err
  assert "missing.png: no such file: /image ignored" in err and "img.png attached to the next turn" in err
  turns = re.findall(r"turn (\d): (\d+) tokens from the cache, (\d+) prefilled", err)
  text = render_messages(demo_dir, [{"role": "user", "content": IMAGE_MARKER + "Describe."}])
  n1 = build_multimodal_inputs(text, load_tokenizer(demo_dir), images=[path]).input_ids.shape[1]
  one_marker = len(load_tokenizer(demo_dir).encode(text, add_special_tokens=False).ids)
  assert turns[0][1:] == ("0", str(n1)) and n1 == one_marker + 2 + 5  # start, 6 placeholders (24 patches / 4), end
  assert int(turns[1][1]) >= n1  # turn 2 re-renders the image turn, served from the cache


# Reliability (#45).


def test_generate_drops_eos_ids_outside_the_vocabulary_with_a_warning(capsys, tmp_path):
  """#45: generate refused HF-made checkpoints whose config carries an eos id outside the vocabulary, with a
  message about eos ids the user never passed."""
  import shutil  # pylint: disable=g-import-not-at-top
  ckpt = tmp_path / "hf"
  shutil.copytree(FIXTURES / "flat_b16" / "checkpoint", ckpt)
  config = json.loads((ckpt / "config.json").read_text())
  config["text_config"]["eos_token_id"] = 200020  # the full model's eos id; this vocabulary has 256 ids
  (ckpt / "config.json").write_text(json.dumps(config))
  (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [300, 200020]}))
  ref = np.load(FIXTURES / "flat_b16" / "reference.npz")
  prompt = ",".join(map(str, ref["input_ids"][0, :ref["gen_prompt_lens"][0]].tolist()))
  want = ref["gen_tokens"][0, :10].tolist()
  base = ["generate", str(ckpt), "--prompt-ids", prompt, "--max-new-tokens", "10", "--kernels", "reference"]
  assert cli.main(base) == 0
  out, err = capsys.readouterr()
  assert [int(t) for t in out.split()] == want
  assert (f"[m3jax] warning: {ckpt}/config.json: eos_token_id 200020 is outside the vocabulary [0, 256), so the "
          "model can never produce it; ignored (--eos-ids sets the stop tokens)") in err
  assert f"{ckpt}/generation_config.json: eos_token_id 300 is outside" in err
  assert cli.main([*base, "--eos-ids", str(want[3])]) == 0  # --eos-ids overrides: no warning, stops at it
  out, err = capsys.readouterr()
  assert [int(t) for t in out.split()] == want[:want.index(want[3]) + 1] and "warning" not in err
  assert cli.main([*base, "--eos-ids", "7,999"]) == 2
  assert capsys.readouterr().err == "m3jax generate: error: --eos-ids outside [0, 256): [999]\n"
  (ckpt / "generation_config.json").write_text("[300]")
  assert cli.main(base) == 2
  assert "generation_config.json: must be a JSON object, got a JSON list" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["batch", "--input", "in.jsonl", "--output", "o.jsonl", "--top-k", "3000000000"],
     "sampling options: top_k must be an integer >= 0 and <= 2147483647"),
    (["generate", "--prompt-ids", "1,2", "--top-k", "3000000000"], "top_k must be an integer >= 0 and <= 2147483647"),
    (["serve", "--top-k", "3000000000"], "top_k must be an integer >= 0 and <= 2147483647"),
    (["chat", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens must be in [1, 2147483647]"),
    (["generate", "--prompt-ids", "1,,2"], "--prompt-ids: entry 1 is ''"),
    (["generate", "--prompt-ids", "1", "--seed", "-1"], "--seed must be in [0, 2147483647], got -1"),
    (["batch", "--input", "in.jsonl", "--output", "o.jsonl", "--batch-size", "0"], "--batch-size must be in [1, "),
    (["serve", "--max-logprobs", "-2"], "--max-logprobs must be >= -1"),
])
def test_options_are_checked_before_the_model_loads(capsys, monkeypatch, demo_dir, tmp_path, argv, message):
  """#45: `m3jax batch --top-k 3000000000` crashed with a traceback (after loading the model)."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
  monkeypatch.setattr(m3jax, "load", lambda *a, **k: pytest.fail("the model was loaded"))
  assert cli.main([argv[0], str(demo_dir), *argv[1:]]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"m3jax {argv[0]}: error: ") and err.count("\n") == 1 and message in err, err


def test_generate_refuses_image_placeholders_without_an_image(capsys, demo_dir):
  from m3jax.vision import IMAGE_MARKER  # pylint: disable=g-import-not-at-top
  assert cli.main(["generate", str(demo_dir), "--prompt", f"{IMAGE_MARKER} Describe.", "--max-new-tokens", "2"]) == 2
  assert ("m3jax generate: error: the prompt ids hold image / video placeholder tokens [5] but no image or video "
          "was given") in capsys.readouterr().err
  model = m3jax.load(demo_dir, kernels="reference")  # with its vision tower: ids 5 / 6 stand for image features
  with pytest.raises(ValueError, match=r"input_ids hold image / video placeholder tokens \[6\]"):
    model(np.asarray([[7, 6, 8]], np.int32))
  with pytest.raises(ValueError, match=r"the prompt ids hold image / video placeholder tokens \[5\]"):
    generate(model, [[7, 8], [5, 9]], max_new_tokens=2)


def test_batch_writes_the_prompts_that_ran_and_reports_the_one_that_failed(capsys, monkeypatch, demo_dir,
                                                                            tmp_path):
  import m3jax.engine as engine_module  # pylint: disable=g-import-not-at-top
  real = engine_module._admit_jit

  def admit(graph, params, prompts, *args, **kwargs):  # a prefill out of memory for buckets of 64+ (simulated)
    if prompts.shape[1] >= 64:
      raise RuntimeError("RESOURCE_EXHAUSTED: simulated out of memory")
    return real(graph, params, prompts, *args, **kwargs)

  monkeypatch.setattr(engine_module, "_admit_jit", admit)
  src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text(json.dumps({"prompt_ids": [7, 8, 9]}) + "\n" + json.dumps({"prompt_ids": list(range(10, 60))}) + "\n")
  assert cli.main(["batch", str(demo_dir), "--input", str(src), "--output", str(dst), "--batch-size", "2",
                   "--max-new-tokens", "5", "--kernels", "reference"]) == 2
  err = capsys.readouterr().err
  assert err.endswith("m3jax batch: error: 1 of 2 prompts failed (their lines in " + str(dst) + " say why; the first, "
                      + str(src) + ":2: RuntimeError: RESOURCE_EXHAUSTED: simulated out of memory)\n")
  ok, failed = [json.loads(x) for x in dst.read_text().splitlines()]
  model = m3jax.load(demo_dir, kernels="reference", text_only=True)
  alone = generate(model, [[7, 8, 9]], max_new_tokens=5, eos_token_ids=model.config.text.eos_token_ids)
  assert ok["completion_ids"] == alone.tokens[0, :alone.lengths[0]].tolist()
  assert failed["finish_reason"] == "error" and "RESOURCE_EXHAUSTED" in failed["error"]
