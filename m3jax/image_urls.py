"""Images sent as OpenAI chat ``image_url`` parts (``m3jax serve``, ``m3jax batch``): the URL checked and decoded
into the resized RGB image the vision preprocessing takes (m3jax.vision.image), every failure a ``RequestError``
(400) naming the part.

Accepted: ``data:`` URLs holding a base64 image (``data:image/png;base64,...``; PNG, JPEG, WebP, GIF, BMP or TIFF,
decoded by pillow), and, where the caller gives a directory to resolve them against (``m3jax batch``: the input
file's), ``file:`` URLs of local images. Never fetched: ``http(s)://`` URLs (the server does not reach out to the
network) and ``file:`` URLs on the server (it does not read its clients' paths).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re

import numpy as np

from m3jax.request_validation import RequestError, url_scheme_error

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_PIXELS", "decode_image_url"]

# What pillow may decode (formats it hands to external programs, such as EPS, are never opened).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# The largest image accepted, in pixels (width x height, read from the header before the pixels are decoded: a
# small file that would decode to gigabytes is refused unread). The vision preprocessing resizes every image to at
# most 672 x 672 anyway.
MAX_IMAGE_PIXELS = 8192 * 8192
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),(?P<data>.*)", re.DOTALL)
_WHITESPACE = re.compile(rb"[ \t\r\n]+")


def decode_image_url(url: str, where: str, *, base_dir: str | os.PathLike | None = None,
                     max_pixels: int = MAX_IMAGE_PIXELS, image_config=None) -> np.ndarray:
  """An image URL -> the image as the vision preprocessing resizes it: uint8 [h', w', 3] (RGB, transparency on
  white, both sides multiples of 28: m3jax.vision.image.resized_image).

  Args:
    url: a ``data:`` URL with base64 image bytes, or with ``base_dir`` a ``file:`` URL (``file:///abs/x.png``, or
      ``file:x.png`` relative to ``base_dir``).
    where: the part, as error messages and ``param`` name it ("messages.[0].content.[1]").
    base_dir: resolve ``file:`` URLs against it (None: ``file:`` URLs are refused).
    max_pixels: the largest width x height accepted.
    image_config: a ``m3jax.vision.ImageProcessorConfig`` (default: the default one).

  Raises:
    RequestError (400, ``param=where``): another scheme, malformed base64, no image data, an image pillow cannot
      read, one over ``max_pixels`` or with an aspect ratio above 200.
  """
  from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top
  from m3jax.vision.image import ImageError, ImageProcessorConfig, resized_image  # pylint: disable=g-import-not-at-top

  def refuse(message: str) -> RequestError:
    return RequestError(f"{where}: {message}", param=where)

  problem = url_scheme_error(url, files=base_dir is not None)
  if problem is not None:
    raise refuse(problem)
  if url[:5].lower() == "file:":
    source = label = _file_path(url, base_dir, refuse)
    if not os.path.isfile(source):
      raise refuse(f"no such image file {source}")
  else:
    source, label = io.BytesIO(_data_bytes(url, refuse)), "the image"
  try:
    with Image.open(source, formats=IMAGE_FORMATS) as image:
      width, height = image.size
      if width * height > max_pixels:
        raise refuse(f"the image is {width}x{height}, over the {max_pixels}-pixel limit")
      image.load()
      image = image.copy()
  except RequestError:
    raise
  except UnidentifiedImageError:
    raise refuse(f"{label} is not an image this server reads ({', '.join(IMAGE_FORMATS)})") from None
  except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
    raise refuse(f"cannot decode {label} ({type(e).__name__}: {e})") from None
  try:
    return resized_image(image, image_config or ImageProcessorConfig(), name="the image")
  except ImageError as e:
    raise refuse(str(e)) from None


def _data_bytes(url: str, refuse) -> bytes:
  """The bytes of a base64 ``data:`` URL (its media type, when given, an image/* one)."""
  match = _DATA_URL.fullmatch(url)
  if match is None:
    raise refuse("a data: URL needs a comma before its data (data:image/png;base64,...)")
  media = match["type"].strip().lower()
  if media and not media.startswith("image/"):
    raise refuse(f"the data: URL holds {media[:40]!r}, not an image (image/png, image/jpeg, ...)")
  if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
    raise refuse("the data: URL must be base64 (data:image/png;base64,...)")
  try:
    data = base64.b64decode(_WHITESPACE.sub(b"", match["data"].encode("ascii")), validate=True)
  except (UnicodeEncodeError, binascii.Error) as e:
    raise refuse(f"the data: URL is not valid base64 ({e})") from None
  if not data:
    raise refuse("the data: URL holds no image data")
  return data


def _file_path(url: str, base_dir: str | os.PathLike, refuse) -> str:
  """``file:///abs/x.png`` / ``file:/abs/x.png`` -> /abs/x.png; ``file:x.png`` -> base_dir/x.png."""
  from urllib.parse import unquote  # pylint: disable=g-import-not-at-top

  path = url[5:]
  if path.startswith("//"):
    path = path[2:]
    if not path.startswith("/"):  # file://host/path: only the local host
      host, _, rest = path.partition("/")
      if host not in ("", "localhost"):
        raise refuse(f"file: URL with host {host[:40]!r}: only local files are read")
      path = "/" + rest
  return os.path.join(os.fspath(base_dir), unquote(path))
