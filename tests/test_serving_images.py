"""Images through ``m3jax serve`` (#49): chat ``image_url`` parts with data: URLs on a server holding the vision
tower get ``generate``'s greedy reply on the rendered ids and ``embed_multimodal``'s embeddings; the prefix cache
serves the same image's pages again (``usage.prompt_tokens_details.cached_tokens``, whole and streamed) and only
the text pages before another image; every bad image part is a 400 naming the part. One served tiny checkpoint
(the demo's, with its vision tower; page size 16) for the whole file."""

import base64
import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from m3jax.generate import generate
from m3jax.tokenizer import render_messages
from m3jax.vision import IMAGE_MARKER, build_multimodal_inputs
from served_checkpoint import served_checkpoint

PAGE = 16  # the demo checkpoint's index block: the engine's page size
PREFACE = "Here is a picture of a quiet field at noon, with a blue sky over it and one small tree on the left:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  with served_checkpoint(tmp_path_factory.mktemp("serve_images"), vision=True) as s:
    yield s


def _png(seed: int, size=(60, 90)) -> Image.Image:
  return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def _data_url(image: Image.Image, fmt="PNG") -> str:
  out = io.BytesIO()
  image.save(out, format=fmt)
  return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def _image_part(url: str) -> dict:
  return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def _chat(served, content, **extra):
  body = {"messages": [{"role": "user", "content": content}], "max_tokens": 5, **extra}
  req = urllib.request.Request(served["url"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    data = r.read().decode()
  if not extra.get("stream"):
    return json.loads(data)
  return [json.loads(line[6:]) for line in data.split("\n\n") if line.startswith("data: {")]


def _refused(served, content) -> dict:
  with pytest.raises(urllib.error.HTTPError) as e:
    _chat(served, content)
  assert e.value.code == 400
  return json.loads(e.value.read())["error"]


def _expected(served, text: str, images: list, max_tokens=5):
  """generate()'s greedy reply on the rendered conversation's ids and embed_multimodal's embeddings -> (text,
  the prompt's ids)."""
  model, tok = served["model"], served["tok"]
  rendered = render_messages(served["ckpt"], [{"role": "user", "content": text}])
  inputs = build_multimodal_inputs(rendered, tok, images=images, image_token_id=model.config.image_token_id)
  embeds = model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs())
  eos = model.config.text.eos_token_ids
  ids = inputs.input_ids[0].tolist()
  out = generate(model, [ids], max_new_tokens=max_tokens, eos_token_ids=eos, prompt_embeds=embeds)
  tokens = out.tokens[0, : out.lengths[0]].tolist()
  return tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True), ids


def test_an_image_reply_equals_generate_and_the_same_image_is_read_from_the_cache(served):
  image = _png(0)
  content = [_image_part(_data_url(image)), {"type": "text", "text": "Describe it."}]
  first = _chat(served, content)
  want, ids = _expected(served, IMAGE_MARKER + "Describe it.", [image])
  assert first["choices"][0]["message"]["content"] == want
  assert first["usage"]["prompt_tokens"] == len(ids) and first["usage"]["prompt_tokens_details"] == {
      "cached_tokens": 0}
  assert ids.count(served["model"].config.image_token_id) == 6  # 60x90 -> 4x6 patches -> 6 merged tokens

  # The same image again, streamed: every full page of its prompt but the last token's comes from the cache.
  chunks = _chat(served, content, stream=True, stream_options={"include_usage": True})
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
  assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // PAGE * PAGE > 0
  again = _chat(served, content)
  assert again["choices"] == first["choices"]
  assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // PAGE * PAGE


def test_another_image_behind_the_same_text_reads_only_the_text_pages_from_the_cache(served):
  a, b = _png(1, (40, 40)), _png(2, (40, 40))  # the same size: the same ids, other pixels
  replies = [_chat(served, [{"type": "text", "text": PREFACE}, _image_part(_data_url(image, fmt))])
             for image, fmt in ((a, "PNG"), (b, "JPEG"))]
  want_a, ids = _expected(served, PREFACE + IMAGE_MARKER, [a])
  b_decoded = Image.open(io.BytesIO(base64.b64decode(_data_url(b, "JPEG").split(",")[1])))
  want_b, ids_b = _expected(served, PREFACE + IMAGE_MARKER, [b_decoded])
  assert ids == ids_b and [r["choices"][0]["message"]["content"] for r in replies] == [want_a, want_b]
  first_image = ids.index(served["model"].config.image_token_id)
  assert first_image >= 2 * PAGE  # the preface fills whole pages before the image
  assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == first_image // PAGE * PAGE


def test_completions_report_the_prompt_tokens_read_from_the_cache(served):
  prompt = PREFACE + " Now tell me what the tree is called."
  n = len(served["tok"].encode(prompt, add_special_tokens=False).ids)
  body = json.dumps({"prompt": [prompt, prompt[:20]], "max_tokens": 2}).encode()
  replies = []
  for _ in range(2):
    req = urllib.request.Request(served["url"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
      replies.append(json.loads(r.read()))
  assert replies[0]["choices"] == replies[1]["choices"]
  # Every full page of the long prompt but its last token's, the second time (the short one has none).
  assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE >= 2 * PAGE


def test_bad_image_parts_are_400s_naming_the_part(served):
  good = _image_part(_data_url(_png(3, (30, 30))))
  text = {"type": "text", "text": "What is it?"}

  def refused(part, *, at=1):
    error = _refused(served, [text, part] if at == 1 else [text, good, part])
    assert error["param"] == f"messages.[0].content.[{at}]" and error["message"].startswith(error["param"])
    return error["message"]

  assert "not fetched (this server does not reach the network)" in refused(_image_part("https://x.org/a.png"))
  assert "file: URLs are not read" in refused(_image_part("file:///etc/hosts"))
  assert "not valid base64" in refused(_image_part("data:image/png;base64,abc$"))
  assert "must be base64" in refused(_image_part("data:image/png,abc"))
  assert "holds 'text/plain', not an image" in refused(_image_part("data:text/plain;base64,aGk="))
  assert "no image data" in refused(_image_part("data:image/png;base64,"))
  assert "not an image this server reads" in refused(
      _image_part("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode()))
  whole = base64.b64decode(_data_url(_png(4)).split(",")[1])
  truncated = "data:image/png;base64," + base64.b64encode(whole[:len(whole) // 2]).decode()
  assert "cannot decode the image" in refused(_image_part(truncated))
  huge = io.BytesIO()
  Image.new("1", (8193, 8192)).save(huge, format="PNG")  # 67 megapixels in a few kilobytes: refused unread
  assert "8193x8192, over the 67108864-pixel limit" in refused(
      _image_part("data:image/png;base64," + base64.b64encode(huge.getvalue()).decode()))
  assert "aspect ratio" in refused(_image_part(_data_url(Image.new("RGB", (300, 1)))))
  error = _refused(served, [good] * 9)
  assert error["param"] == "messages.[0].content.[8]" and "at most 8 images per request" in error["message"]
  assert "image_url.detail must be a string" in refused({"type": "image_url", "image_url": {"url": "data:,",
                                                                                           "detail": 1}})
  # Random bytes as an image: never a 500.
  rng = np.random.default_rng(5)
  for n in (1, 7, 64, 1000):
    blob = base64.b64encode(rng.integers(0, 256, n, dtype=np.uint8).tobytes()).decode()
    refused(_image_part("data:image/png;base64," + blob))
  # A marker typed into the text has no image behind it.
  error = _refused(served, [{"type": "text", "text": IMAGE_MARKER + " and"}, good])
  assert error["param"] == "messages" and "2 image markers" in error["message"]
  with urllib.request.urlopen(served["url"] + "/health") as r:
    assert json.loads(r.read()) == {"status": "ok"}


@pytest.mark.quick
def test_image_urls_decode_data_and_refuse_what_the_server_does_not_fetch(tmp_path):
  """m3jax.image_urls without a server: a data: URL decodes to the vision preprocessing's size (multiples of
  28), a file: URL only where a base directory is given (batch), and every other scheme or bad payload is a
  400 naming the part."""
  from m3jax.image_urls import decode_image_url
  from m3jax.request_validation import RequestError

  image = decode_image_url(_data_url(_png(0)), "messages.[0].content.[1]")
  assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
  assert image.shape[0] % 28 == 0 and image.shape[1] % 28 == 0
  _png(0).save(tmp_path / "x.png")
  assert (decode_image_url("file:x.png", "line 3", base_dir=tmp_path) == image).all()
  for url, says in [("https://example.com/x.png", "not fetched"), ("file:x.png", "file"),
                    ("data:image/png;base64,@@@", "base64"), ("data:text/plain;base64,aGk=", "not an image"),
                    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "")]:
    with pytest.raises(RequestError, match="messages.\\[0\\].content.\\[1\\]: ") as e:
      decode_image_url(url, "messages.[0].content.[1]")
    assert e.value.status == 400 and e.value.param == "messages.[0].content.[1]", url
    assert says.lower() in str(e.value).lower(), (url, str(e.value))
