# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # m3jax quickstart: load, generate, stream, batch
#
# This notebook runs on a CPU in a minute. It builds the tiny built-in M3 checkpoint (the original MiniMax
# tensor layout, random weights, a small BPE tokenizer), loads it with `m3jax.load`, and generates.
# With a real checkpoint, only the path changes.

# %%
import tempfile
import time

import numpy as np

import m3jax
from m3jax.demo import build_demo_checkpoint
from m3jax.tokenizer import load_tokenizer

ckpt = build_demo_checkpoint(tempfile.mkdtemp() + "/tiny-m3")
model = m3jax.load(ckpt)
tok = load_tokenizer(ckpt)
cfg = model.config.text
print(f"{cfg.num_layers} layers: attention {cfg.attention_types}, MLP {cfg.mlp_types}; dtype {model.dtype}")

# %% [markdown]
# ## One forward pass
# `model(input_ids)` takes int32 `[batch, seq]` and returns float32 logits `[batch, seq, vocab]`.

# %%
ids = np.asarray([tok.encode("The lightning indexer reads every key once.").ids], np.int32)
logits = model(ids)
print(ids.shape, "->", logits.shape, logits.dtype)
print("next token:", tok.decode([int(logits[0, -1].argmax())]))

# %% [markdown]
# ## Generate
# `m3jax.generate` runs prefill and the whole decode loop as one jit-compiled program. Greedy by default;
# `temperature`, `top_k`, `top_p` and `seed` give reproducible sampling.

# %%
prompt = tok.encode("What is sparse attention?").ids
start = time.perf_counter()
out = m3jax.generate(model, [prompt], max_new_tokens=20)
print(f"{time.perf_counter() - start:.1f}s (includes compilation)")
print(repr(tok.decode(out.tokens[0, : out.lengths[0]].tolist())))

sampled = m3jax.generate(model, [prompt], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1)
assert (sampled.tokens == m3jax.generate(model, [prompt], max_new_tokens=20, temperature=0.8, top_p=0.9,
                                         seed=1).tokens).all()  # same seed, same tokens

# %% [markdown]
# ## Stream
# `m3jax.generate_stream` yields the new tokens of every sequence as they are produced.

# %%
text_ids = []
for step in m3jax.generate_stream(model, [prompt], max_new_tokens=12):
  text_ids.append(int(step[0]))
print(repr(tok.decode(text_ids)))

# %% [markdown]
# ## Batch
# Prompts of different lengths are right-padded to a shared bucket; caches are anchored to each sequence's
# own positions, so every sequence gets exactly the tokens it would get alone.

# %%
prompts = [tok.encode(t).ids for t in ["Hello, world.", "A block holds one hundred and twenty-eight keys,",
                                         "Why a shared expert?"]]
batch = m3jax.generate(model, prompts, max_new_tokens=10)
for p, row in zip(prompts, batch.tokens):
  alone = m3jax.generate(model, [p], max_new_tokens=10).tokens[0]
  print((row == alone).all(), repr(tok.decode(row.tolist())))

# %% [markdown]
# ## Long prompts: chunked prefill
# `prefill_chunk=N` (a power of two) prefills in chunks of N tokens, one compiled forward in a `lax.scan`, each
# chunk attending to the cache of the ones before: the prefill's activation memory is a chunk's, not the whole
# prompt's. The tokens are the same up to floating-point reassociation (bf16 here).

# %%
long_prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 20).ids
whole = m3jax.generate(model, [long_prompt], max_new_tokens=8)
chunked = m3jax.generate(model, [long_prompt], max_new_tokens=8, prefill_chunk=64)
print(len(long_prompt), "prompt tokens in chunks of 64; same tokens:", bool((whole.tokens == chunked.tokens).all()))

# %% [markdown]
# ## Multi-turn: a conversation that keeps its caches
# `m3jax.Conversation` holds one sequence's caches across turns. Each `reply` takes the whole conversation so far
# (here rendered by the checkpoint's chat template) and prefills only the tokens past what the caches already
# hold; each reply equals `generate` on the whole conversation, up to bf16 reassociation. `m3jax chat CKPT` does
# this on stdin.

# %%
from m3jax.tokenizer import render_messages

conv = m3jax.Conversation(model, max_length=1024)
messages = []
for question in ["What is sparse attention?", "And the shared expert?"]:
  messages.append({"role": "user", "content": question})
  ids = tok.encode(render_messages(ckpt, messages), add_special_tokens=False).ids
  reply = np.concatenate(list(conv.reply(ids, max_new_tokens=12))).tolist()
  same = reply == m3jax.generate(model, [ids], max_new_tokens=12).tokens[0, : len(reply)].tolist()
  turn = conv.last_turn
  print(f"{turn.reused} tokens from the cache, {turn.prefilled} prefilled; same as generate: {same}:",
        repr(tok.decode(reply)))
  messages.append({"role": "assistant", "content": tok.decode(reply)})

# %% [markdown]
# ## Many requests: continuous batching
# `m3jax.engine.Engine` decodes a fixed number of cache slots together and refills a slot with the next request as
# soon as its own stops, so short completions do not wait for long ones (`m3jax batch` runs it over a JSONL
# file). Greedy completions are each request's own `generate` tokens.

# %%
from m3jax.engine import Engine

engine = Engine(model, slots=2, max_length=128)
for i, (p, n) in enumerate(zip(prompts, [4, 12, 6])):
  engine.submit(p, max_new_tokens=n, request_id=i)
for done in engine.run():
  print(done.request_id, done.finish_reason, repr(tok.decode(done.tokens.tolist())))

# %% [markdown]
# ## Scoring: log-probabilities and perplexity
# `m3jax.token_logprobs` scores every token given the ones before it (the log-softmax runs inside the program, per
# chunk with `prefill_chunk`, so a long text never holds [tokens, vocab] logits); `score_continuations` sums a
# continuation's log-likelihood, as evaluation harnesses do. `m3jax score CKPT --text-file F` prints a text's
# perplexity: the quickest check of a converted checkpoint. (Random weights: about the vocabulary size.)

# %%
scored = m3jax.token_logprobs(model, [long_prompt], prefill_chunk=64)
print(f"{scored.scored_tokens} tokens, perplexity {scored.perplexity():.1f} (vocabulary {cfg.vocab_size})")
choice = m3jax.score_continuations(model, [prompt, prompt], [out.tokens[0, :5].tolist(), prompts[1][:5]])
print("log-likelihoods", choice.logprob, "greedy", choice.greedy)

# %% [markdown]
# ## Speculative decoding with the MTP module
# The demo checkpoint, like M3's, carries one multi-token-prediction (MTP) module. `with_mtp=True` loads it, and
# `generate_speculative` drafts `num_draft_tokens` tokens per round with it, then verifies them in one target
# forward. Greedy tokens are exactly `generate`'s; the output also records every round's drafts and how many the
# target kept. (Random weights: the drafts are rarely right. A trained module's acceptance sets the speedup.)

# %%
from m3jax.speculative import generate_speculative

spec_model = m3jax.load(ckpt, with_mtp=True)
spec = generate_speculative(spec_model, [prompt], max_new_tokens=20, num_draft_tokens=2)
assert (spec.tokens == out.tokens).all()  # same tokens as generate above
print(f"{spec.rounds[0]} rounds, acceptance {spec.acceptance_rate:.2f}, {spec.tokens_per_round:.2f} tokens per round")
print("round 0 drafted", spec.drafts[0, 0].tolist(), "- kept", spec.accepted_drafts[0, 0])

# %% [markdown]
# `generate_speculative_stream` yields each sequence's new tokens as the rounds produce them (here 2 rounds per
# device call); concatenated, they are the same tokens.

# %%
from m3jax.speculative import generate_speculative_stream

chunks = [c[0].tolist() for c in generate_speculative_stream(spec_model, [prompt], max_new_tokens=20,
                                                                num_draft_tokens=2, rounds_per_call=2)]
print("chunks:", chunks)
assert sum(chunks, []) == spec.tokens[0, : spec.lengths[0]].tolist()
