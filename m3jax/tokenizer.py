"""Tokenizer, chat template and stop tokens of a checkpoint directory (``tokenizers`` + jinja2)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
  """The checkpoint's chat template refused the messages (it called ``raise_exception``) or failed on them."""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """The checkpoint's tokenizer.json (real M3 checkpoints ship one)."""
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"{file}: no tokenizer.json; pass token ids with --prompt-ids instead")
  return Tokenizer.from_file(file)


def _read_json(path: str | os.PathLike, name: str) -> dict[str, Any]:
  """A side file's JSON object ({} if the file is absent); ValueError naming the file if it is not one."""
  file = os.path.join(os.fspath(path), name)
  if not os.path.exists(file):
    return {}
  try:
    with open(file, "rb") as f:
      data = json.loads(f.read())
  except (ValueError, RecursionError) as e:
    raise ValueError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{file}: must be a JSON object, got a JSON {type(data).__name__}")
  return data


def generation_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
  """eos_token_id from generation_config.json (int or list), () if absent; ValueError naming the file for
  anything but integers."""
  eos = _read_json(path, "generation_config.json").get("eos_token_id")
  if eos is None:
    return ()
  ids = eos if isinstance(eos, list) else [eos]
  bad = [e for e in ids if not isinstance(e, int) or isinstance(e, bool)]
  if bad:
    raise ValueError(f"{os.path.join(os.fspath(path), 'generation_config.json')}: eos_token_id must be an integer "
                     f"or a list of them, got {eos!r:.60}")
  return tuple(ids)


def stop_token_ids(path: str | os.PathLike, config_eos: tuple[int, ...]) -> tuple[int, ...]:
  """A checkpoint's stop tokens: the config's eos ids, then generation_config.json's, without repeats."""
  return tuple(dict.fromkeys(tuple(config_eos) + generation_eos_ids(path)))


def render_chat(path: str | os.PathLike, user_message: str) -> str:
  """Applies tokenizer_config.json's chat_template to one user turn, with the generation prompt."""
  return render_messages(path, [{"role": "user", "content": user_message}])


def render_messages(path: str | os.PathLike, messages: list[dict[str, str]], add_generation_prompt: bool = True
                    ) -> str:
  """Applies the checkpoint's chat template (tokenizer_config.json's chat_template, or chat_template.jinja) to a
  conversation: ``messages`` as [{"role": "system" | "user" | "assistant", "content": text}, ...]."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  cfg = _read_json(path, "tokenizer_config.json")
  template = cfg.get("chat_template")
  if template is None and os.path.exists(os.path.join(os.fspath(path), "chat_template.jinja")):
    with open(os.path.join(os.fspath(path), "chat_template.jinja")) as f:
      template = f.read()
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
  if not template:
    raise ValueError(f"{path}: chat needs a chat_template in tokenizer_config.json (or chat_template.jinja)")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
      raise ValueError(f"message {i} must be {{'role': ..., 'content': str}}, got {m!r}")
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
  env.globals["raise_exception"] = _raise_exception  # what HF templates call to refuse a conversation
  try:
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=cfg.get("bos_token") or "", eos_token=cfg.get("eos_token") or "")
  except ChatTemplateError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (the template is the checkpoint's code)
    raise ChatTemplateError(f"{path}: the chat template failed on these messages ({type(e).__name__}: {e})") from None


def _raise_exception(message: str) -> None:
  raise ChatTemplateError(f"the chat template refused the messages: {message}")
