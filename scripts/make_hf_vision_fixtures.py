"""Build golden HF-reference fixtures for the MiniMax M3 vision path (tower, projector, preprocessing, prompts).

Writes two folders (run with the HF reference venv: torch CPU + transformers 5.23.0 + torchvision + pillow):

* ``vl_tiny/``: a tiny randomised fp32 ``MiniMaxM3SparseForConditionalGeneration`` (vision head dim 20, so 18 of
  20 channels rotate like M3's 78 of 80; LayerNorms, biases and RMSNorm offsets all randomised), saved in the
  original MiniMax layout (``checkpoint/``, what ``save_pretrained`` writes) and in HF's in-memory layout
  (``checkpoint_hf/``, the ``state_dict()`` names), a char-level tokenizer whose four vision markers are special
  tokens, 3 images with different grids and a 3-frame video (padded to 2 temporal patches, with fps metadata so
  the prompt carries timestamps), and ``reference.npz``: the HF processor's input_ids / pixel arrays / grids,
  the fp32 logits, the vision-tower output, the projected features, and the tower output for the video split
  into 1-temporal-patch segments (``vision_segment_max_frames=1``).
* ``vl_preprocess/``: images of assorted sizes / modes (tiny, huge, extreme aspect ratio, side <= 14 px,
  grayscale, RGBA, JPEG) and a 9-frame video, with HF's image / video processor outputs: grids, token
  counts, HF's resized uint8 images (small ones), pixel-value statistics and sub-arrays.

Robustness: the seed is rejected if an indexer top-k or router top-k decision is a near-tie (probes from
``make_hf_fixtures.py``), so fp32 rounding differences cannot flip a discrete choice.

  /tmp/venvref/bin/python scripts/make_hf_vision_fixtures.py --out-dir tests/fixtures

torchvision: the PyPI wheel is a CUDA build whose C extension does not load next to a CPU-only torch; the
image / video processors only need its Python resize, so the two custom-op schemas it registers fake kernels for
are declared first when its extension is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch


def _import_torchvision() -> None:
  """Imports torchvision, declaring torchvision::nms / qnms when its C extension cannot be loaded."""
  try:
    import torchvision  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
    return
  except RuntimeError as e:
    if "torchvision::nms" not in str(e):
      raise
  for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
    del sys.modules[mod]
  lib = torch.library.Library("torchvision", "DEF")  # pylint: disable=unused-variable
  lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  globals()["_TV_LIB"] = lib  # keep the definitions alive
  import torchvision  # noqa: F401,F811  # pylint: disable=g-import-not-at-top,unused-import,reimported


_import_torchvision()

import transformers  # noqa: E402  # pylint: disable=g-import-not-at-top
from PIL import Image  # noqa: E402  # pylint: disable=g-import-not-at-top
from safetensors import safe_open  # noqa: E402  # pylint: disable=g-import-not-at-top
from safetensors.torch import save_file  # noqa: E402  # pylint: disable=g-import-not-at-top
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers  # noqa: E402  # pylint: disable=g-import-not-at-top
from transformers import (MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig,  # noqa: E402  # pylint: disable=g-import-not-at-top
                          MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor,
                          PreTrainedTokenizerFast)
from transformers.video_utils import VideoMetadata  # noqa: E402  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import (IndexerProbe, RouterProbe, randomize_)  # noqa: E402  # pylint: disable=g-import-not-at-top

MARKERS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]
MARKER_IDS = [250, 251, 252, 253]
VOCAB = 256
TEXT = dict(
  hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
  rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}, rotary_dim=8,
  index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=3, index_local_blocks=1,
  num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
  dense_intermediate_size=64, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
  layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
  vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None, max_position_embeddings=4096,
  tie_word_embeddings=False)
VISION = dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
PROJECTOR_HIDDEN = 48
PROMPT = ("Three pictures: ]<]image[>[ then ]<]image[>[ and a clip ]<]video[>[ and last ]<]image[>[. "
          "Which one shows the brightest sky, and what moves in the clip? Answer briefly.")
VIDEO_FPS, VIDEO_INDICES = 2.0, [0, 3, 5]  # a 3-frame clip sampled from a 2-fps source: stamps 0.0 s, 2.5 s
MIN_INDEX_REL_GAP = 1e-4
MIN_ROUTER_GAP = 3e-5
SUB_ROWS = 12  # pixel rows kept at each end of a big image's pixel_values


# ----------------------------------------------------------------------------------------------------------------
# Deterministic synthetic pictures
# ----------------------------------------------------------------------------------------------------------------


def smooth_image(h: int, w: int, seed: int, noise: float = 6.0) -> np.ndarray:
  """uint8 [h, w, 3]: gradients, waves, a disc and mild noise (photo-like: smooth regions plus edges)."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:h, 0:w].astype(np.float64)
  base = 90 + 80 * (x / max(w - 1, 1)) + 40 * np.sin(y / max(h, 2) * 6.0 + seed)
  img = np.stack([base, 160 - 0.5 * base + 30 * np.cos(x / 7.0), 60 + 120 * (y / max(h - 1, 1))], -1)
  disc = (y - 0.4 * h) ** 2 + (x - 0.6 * w) ** 2 < (0.25 * min(h, w)) ** 2
  img[disc] = [230.0, 40.0, 50.0]
  img += rng.normal(0.0, noise, img.shape)
  return np.clip(np.round(img), 0, 255).astype(np.uint8)


def pattern_image(h: int, w: int) -> np.ndarray:
  """uint8 [h, w, 3] arithmetic pattern (compresses well as PNG; hard, aliasing content for resizers)."""
  y, x = np.mgrid[0:h, 0:w]
  return np.stack([(x * 7 + y * 3) % 256, (x // 9 + y // 5) % 256, ((x - y) // 4) % 256], -1).astype(np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# HF pieces
# ----------------------------------------------------------------------------------------------------------------


def build_tokenizer() -> Tokenizer:
  """Char-level WordLevel tokenizer (printable ASCII = ids 1..95) with the four vision markers as special tokens."""
  vocab = {"[UNK]": 0, **{chr(c): i + 1 for i, c in enumerate(range(32, 127))}}
  vocab.update(dict(zip(MARKERS, MARKER_IDS)))
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
  return tok


def build_processor(tok: Tokenizer) -> MiniMaxM3VLProcessor:
  """HF's M3 processor around the tiny tokenizer (default image / video processors)."""
  hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  return MiniMaxM3VLProcessor(image_processor=MiniMaxM3VLImageProcessor(), tokenizer=hf_tok,
                              video_processor=MiniMaxM3VLVideoProcessor())


def build_model(seed: int) -> MiniMaxM3SparseForConditionalGeneration:
  """The randomised fp32 eager tiny VL model."""
  cfg = MiniMaxM3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), projector_hidden_size=PROJECTOR_HIDDEN,
                          image_token_index=MARKER_IDS[0], video_token_index=MARKER_IDS[1], tie_word_embeddings=False)
  torch.manual_seed(seed)
  model = MiniMaxM3SparseForConditionalGeneration._from_config(cfg, dtype=torch.float32, attn_implementation="eager")
  randomize_(model, seed)
  return model.eval()


class ResizeRecorder:
  """Wraps an HF image / video processor's ``resize`` and records its uint8 outputs."""

  def __init__(self, proc):
    self.outputs: list[np.ndarray] = []
    inner = proc.resize

    def resize(*args, **kwargs):
      out = inner(*args, **kwargs)
      self.outputs.append(out.detach().cpu().numpy())
      return out

    proc.resize = resize


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _stats(pv: np.ndarray) -> dict[str, list[float]]:
  """Per-channel mean / std / min / max of pixel rows [N, 3*T*P*P] (channel-major rows)."""
  per_c = pv.reshape(pv.shape[0], 3, -1).transpose(1, 0, 2).reshape(3, -1).astype(np.float64)
  return dict(mean=per_c.mean(1).tolist(), std=per_c.std(1).tolist(), min=per_c.min(1).tolist(),
              max=per_c.max(1).tolist())


# ----------------------------------------------------------------------------------------------------------------
# vl_tiny
# ----------------------------------------------------------------------------------------------------------------


def tiny_inputs(fdir: str) -> tuple[list[str], np.ndarray]:
  """Writes the three images and the video frames; returns (image paths, frames uint8 [3, 50, 60, 3])."""
  os.makedirs(os.path.join(fdir, "media"), exist_ok=True)
  paths = []
  for i, (h, w) in enumerate([(60, 90), (40, 40), (100, 70)]):  # grids (1,4,6), (1,4,4), (1,8,4)
    p = os.path.join(fdir, "media", f"image{i}_{h}x{w}.png")
    Image.fromarray(smooth_image(h, w, seed=10 + i)).save(p)
    paths.append(p)
  frames = np.stack([smooth_image(50, 60, seed=20 + t) for t in range(3)])  # -> grid (2, 4, 4) after padding
  np.save(os.path.join(fdir, "media", "video_3x50x60.npy"), frames)
  return paths, frames


def run_processor(proc: MiniMaxM3VLProcessor, image_paths: list[str], frames: np.ndarray, **video_kwargs):
  """HF processor outputs (numpy) for the tiny prompt."""
  meta = VideoMetadata(total_num_frames=len(frames), fps=VIDEO_FPS, frames_indices=list(VIDEO_INDICES))
  images = [Image.open(p) for p in image_paths]
  out = proc(text=[PROMPT], images=images, videos=[frames], return_tensors="pt",
             videos_kwargs=dict(do_resize=True, video_metadata=[meta], **video_kwargs))
  return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


@torch.no_grad()
def evaluate(model, inputs) -> dict[str, np.ndarray]:
  """HF logits, tower outputs and projected features for the processor inputs."""
  t = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()
       if k in ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  logits = model(**t).logits[0]
  tower = model.model.vision_tower
  img_tower = tower(pixel_values=t["pixel_values"], grid_thw=t["image_grid_thw"]).last_hidden_state[0]
  vid_tower = tower(pixel_values=t["pixel_values_videos"], grid_thw=t["video_grid_thw"]).last_hidden_state[0]
  img_feats = torch.cat(model.model.get_image_features(t["pixel_values"], t["image_grid_thw"]).pooler_output)
  vid_feats = torch.cat(model.model.get_video_features(t["pixel_values_videos"], t["video_grid_thw"]).pooler_output)
  split_grid = torch.tensor([[1, *t["video_grid_thw"][0, 1:].tolist()]] * int(t["video_grid_thw"][:, 0].sum()))
  vid_split = tower(pixel_values=t["pixel_values_videos"], grid_thw=split_grid).last_hidden_state[0]
  return dict(logits=logits.numpy(), image_tower=img_tower.numpy(), video_tower=vid_tower.numpy(),
              image_features=img_feats.numpy(), video_features=vid_feats.numpy(),
              video_tower_split1=vid_split.numpy(), video_split1_grid_thw=split_grid.numpy())


def make_vl_tiny(out_dir: str, base_seed: int, max_tries: int) -> dict:
  """Builds and writes the vl_tiny fixture; returns its meta."""
  fdir = os.path.join(out_dir, "vl_tiny")
  shutil.rmtree(fdir, ignore_errors=True)
  os.makedirs(fdir)
  tok = build_tokenizer()
  tok.save(os.path.join(fdir, "tokenizer.json"))
  proc = build_processor(tok)
  image_paths, frames = tiny_inputs(fdir)
  inputs = run_processor(proc, image_paths, frames)
  split_inputs = run_processor(proc, image_paths, frames, vision_segment_max_frames=1)
  assert np.array_equal(split_inputs["input_ids"], inputs["input_ids"])
  assert np.array_equal(split_inputs["pixel_values_videos"], inputs["pixel_values_videos"])
  rejected = []
  for attempt in range(max_tries):
    seed = base_seed + attempt
    model = build_model(seed)
    iprobe, rprobe = IndexerProbe(model), RouterProbe(model)
    ref = evaluate(model, inputs)
    iprobe.remove()
    rprobe.remove()
    index_gap = min(v["min_rel_gap"] for v in iprobe.stats.values())
    router_gap = min(v["min_gap"] for v in rprobe.stats.values())
    pruned = sum(v["pruned_rows"] for v in iprobe.stats.values())
    ok = index_gap >= MIN_INDEX_REL_GAP and router_gap >= MIN_ROUTER_GAP and pruned > 0
    print(f"[vl_tiny] seed {seed}: index gap {index_gap:.2e} router gap {router_gap:.2e} pruned rows {pruned} "
          f"{'OK' if ok else 'rejected'}", flush=True)
    if ok:
      break
    rejected.append(seed)
  else:
    raise RuntimeError(f"vl_tiny: no acceptable seed in {max_tries} tries")
  ckpt = os.path.join(fdir, "checkpoint")
  model.save_pretrained(ckpt, safe_serialization=True)
  gen_cfg = os.path.join(ckpt, "generation_config.json")
  if os.path.exists(gen_cfg):
    os.remove(gen_cfg)
  reloaded = MiniMaxM3SparseForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
  assert np.array_equal(evaluate(reloaded, inputs)["logits"], ref["logits"]), "reload changed the logits"
  hf_dir = os.path.join(fdir, "checkpoint_hf")
  os.makedirs(hf_dir)
  save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(hf_dir, "model.safetensors"),
            metadata={"format": "pt"})
  shutil.copy(os.path.join(ckpt, "config.json"), os.path.join(hf_dir, "config.json"))
  np.savez_compressed(
      os.path.join(fdir, "reference.npz"),
      input_ids=inputs["input_ids"].astype(np.int32), pixel_values=inputs["pixel_values"].astype(np.float32),
      image_grid_thw=inputs["image_grid_thw"].astype(np.int64),
      pixel_values_videos=inputs["pixel_values_videos"].astype(np.float32),
      video_grid_thw=inputs["video_grid_thw"].astype(np.int64),
      **{k: v.astype(np.int64 if k.endswith("grid_thw") else np.float32) for k, v in ref.items()})
  with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
    names = sorted(f.keys())
  meta = dict(
      name="vl_tiny", seed=seed, rejected_seeds=rejected,
      versions=dict(transformers=transformers.__version__, torch=torch.__version__, numpy=np.__version__),
      hf_class="MiniMaxM3SparseForConditionalGeneration", dtype="float32", attn_implementation="eager",
      text_config=TEXT, vision_config=VISION, projector_hidden_size=PROJECTOR_HIDDEN,
      marker_ids=dict(zip(MARKERS, MARKER_IDS)), prompt=PROMPT,
      images=[os.path.relpath(p, fdir) for p in image_paths], video="media/video_3x50x60.npy",
      video_metadata=dict(fps=VIDEO_FPS, frames_indices=VIDEO_INDICES),
      image_grid_thw=inputs["image_grid_thw"].tolist(), video_grid_thw=inputs["video_grid_thw"].tolist(),
      seq_len=int(inputs["input_ids"].shape[1]),
      robustness=dict(min_index_rel_gap=index_gap, min_router_gap=router_gap, pruned_query_rows=pruned),
      checkpoint_original_vision_names=[n for n in names if not n.startswith("language_model.")][:6],
      logits_absmax=float(np.abs(ref["logits"]).max()),
      files={os.path.relpath(os.path.join(r, f), fdir): _sha256(os.path.join(r, f))
             for r, _, fs in os.walk(fdir) for f in sorted(fs)})
  with open(os.path.join(fdir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
    f.write("\n")
  return meta


# ----------------------------------------------------------------------------------------------------------------
# vl_preprocess
# ----------------------------------------------------------------------------------------------------------------


def preprocess_images_spec() -> list[tuple[str, str, np.ndarray]]:
  """(file name, PIL mode, uint8 pixels) of the preprocessing test images."""
  rgba = np.concatenate([smooth_image(120, 90, 5), np.zeros((120, 90, 1), np.uint8)], -1)
  rgba[..., 3] = np.linspace(0, 255, 90).astype(np.uint8)[None, :]  # alpha ramp 0..255
  return [
      ("tiny_8x8.png", "RGB", smooth_image(8, 8, 1)),
      ("huge_2400x3600.png", "RGB", pattern_image(2400, 3600)),
      ("extreme_30x4000.png", "RGB", smooth_image(30, 4000, 2, noise=1.0)),
      ("thin_10x400.png", "RGB", smooth_image(10, 400, 3)),
      ("gray_150x200.png", "L", smooth_image(150, 200, 4)[..., 1]),
      ("rgba_120x90.png", "RGBA", rgba),
      ("photo_333x500.jpg", "RGB", smooth_image(333, 500, 6)),
  ]


def make_vl_preprocess(out_dir: str) -> dict:
  """Builds and writes the vl_preprocess fixture; returns its meta."""
  fdir = os.path.join(out_dir, "vl_preprocess")
  shutil.rmtree(fdir, ignore_errors=True)
  os.makedirs(os.path.join(fdir, "media"))
  arrays: dict[str, np.ndarray] = {}
  meta: dict = dict(versions=dict(transformers=transformers.__version__, torch=torch.__version__),
                    sub_rows=SUB_ROWS, images={}, video={})
  for fname, mode, pixels in preprocess_images_spec():
    path = os.path.join(fdir, "media", fname)
    img = Image.fromarray(pixels, mode=mode) if mode != "RGB" else Image.fromarray(pixels)
    img.save(path, **({"quality": 90} if fname.endswith(".jpg") else {}))
    proc = MiniMaxM3VLImageProcessor()
    rec = ResizeRecorder(proc)
    out = proc(images=[Image.open(path)], return_tensors="pt")
    pv, grid = out["pixel_values"].numpy(), out["image_grid_thw"].numpy()
    key = fname.split(".")[0]
    resized = rec.outputs[0][0].transpose(1, 2, 0)  # [h', w', 3] uint8
    entry = dict(file=f"media/{fname}", mode=mode, size_hw=list(pixels.shape[:2]), grid_thw=grid[0].tolist(),
                 num_tokens=int(pv.shape[0]) // 4, resized_hw=list(resized.shape[:2]), stats=_stats(pv))
    if resized.size <= 100_000:
      arrays[f"{key}__resized"] = resized
      entry["resized_stored"] = True
    arrays[f"{key}__head"] = pv[:SUB_ROWS]
    arrays[f"{key}__tail"] = pv[-SUB_ROWS:]
    meta["images"][key] = entry
  # A 9-frame video (odd count: padded to 10; grid_t 5 -> chunks of 4 + 1) with the default video processor.
  frames = np.stack([smooth_image(45, 70, 30 + t) for t in range(9)])
  np.save(os.path.join(fdir, "media", "video_9x45x70.npy"), frames)
  vproc = MiniMaxM3VLVideoProcessor()
  rec = ResizeRecorder(vproc)
  out = vproc(videos=[frames], return_tensors="pt")
  pv = out["pixel_values_videos"].numpy()
  arrays["video__pixel_values"] = pv.astype(np.float32)
  meta["video"] = dict(file="media/video_9x45x70.npy", grid_thw=out["video_grid_thw"].numpy().tolist(),
                       num_chunks=[int(c) for c in out["num_chunks_per_video"]], resized_hw=list(rec.outputs[0].shape[-2:]),
                       stats=_stats(pv))
  np.savez_compressed(os.path.join(fdir, "hf_outputs.npz"), **arrays)
  meta["files"] = {os.path.relpath(os.path.join(r, f), fdir): _sha256(os.path.join(r, f))
                   for r, _, fs in os.walk(fdir) for f in sorted(fs)}
  with open(os.path.join(fdir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
    f.write("\n")
  return meta


def main() -> None:
  """CLI entry point."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out-dir", default="tests/fixtures")
  ap.add_argument("--seed", type=int, default=4321)
  ap.add_argument("--max-seed-tries", type=int, default=20)
  args = ap.parse_args()
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  meta = make_vl_tiny(args.out_dir, args.seed, args.max_seed_tries)
  print(json.dumps({k: meta[k] for k in ("seed", "seq_len", "image_grid_thw", "video_grid_thw", "robustness")}))
  pmeta = make_vl_preprocess(args.out_dir)
  print(json.dumps({k: (v["grid_thw"], v["num_tokens"]) for k, v in pmeta["images"].items()}))
  print(json.dumps(pmeta["video"]["grid_thw"]))
  assert all(math.isfinite(x) for x in meta["robustness"].values())


if __name__ == "__main__":
  main()
