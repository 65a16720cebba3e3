"""Token ids and sampling parameters handed to the generation functions: floats, bools, out-of-vocabulary stop
ids, empty batches and non-finite temperatures fail with a message naming them (no silent int() truncation)."""

import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.generate import pad_prompts
from m3jax.token_ids import check_in_vocab, is_token_id, parse_token_ids, resolve_stop_ids, token_list

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier


def test_integer_kinds_are_token_ids_and_floats_and_bools_are_not():
  assert all(is_token_id(v) for v in (3, np.int32(3), np.int64(3), np.asarray(3), jnp.asarray(3, jnp.int32)))
  assert not any(is_token_id(v) for v in (3.0, 1.5, True, np.bool_(True), np.float32(2), "3", jnp.asarray(3.0)))


def test_token_list_keeps_integers_and_names_the_first_bad_entry():
  assert token_list([1, np.int64(2), jnp.asarray(3)], "p") == [1, 2, 3]
  assert token_list(np.arange(4, dtype=np.int16), "p") == [0, 1, 2, 3]
  with pytest.raises(ValueError, match=r"prompt 2: token ids must be integers, got 1.7 \(float\) at index 1"):
    token_list([5, 1.7], "prompt 2")
  with pytest.raises(ValueError, match="got dtype float32"):
    token_list(np.asarray([1.0, 2.0], np.float32), "p")
  with pytest.raises(ValueError, match="got a str"):
    token_list("hello", "p")
  with pytest.raises(ValueError, match=r"got shape \(1, 2\)"):
    token_list(np.zeros((1, 2), np.int32), "p")


def test_pad_prompts_rejects_floats_empty_prompts_and_empty_batches():
  padded, lengths = pad_prompts([[4, 5, 6], np.asarray([7], np.int64)])
  assert padded.dtype == np.int32 and padded.shape == (2, 16)
  np.testing.assert_array_equal(padded[:, :3], [[4, 5, 6], [7, 0, 0]])
  np.testing.assert_array_equal(lengths, [3, 1])
  with pytest.raises(ValueError, match="prompt 1: token ids must be integers, got 2.5"):
    pad_prompts([[1], [2.5]])
  with pytest.raises(ValueError, match="got dtype float64"):
    pad_prompts(np.ones((2, 3)))
  with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
    pad_prompts([[1], []])
  with pytest.raises(ValueError, match="non-empty batch"):
    pad_prompts([])


def test_stop_ids_default_to_the_config_and_must_lie_in_the_vocabulary():
  assert resolve_stop_ids(None, (2,), 10) == (2,)
  assert resolve_stop_ids([], (2,), 10) == ()
  assert resolve_stop_ids((9, np.int32(0)), (2,), 10) == (9, 0)
  with pytest.raises(ValueError, match=r"eos_token_ids outside \[0, 10\): \[10, -1\]"):
    resolve_stop_ids([3, 10, -1], (2,), 10)
  with pytest.raises(ValueError, match=r"single id 7; write \[7\]"):
    resolve_stop_ids(7, (2,), 10)
  with pytest.raises(ValueError, match="eos_token_ids: token ids must be integers"):
    resolve_stop_ids([2.0], (2,), 10)
  check_in_vocab([0, 9], 10, "x")


def test_command_line_id_lists_name_the_bad_entry():
  assert parse_token_ids(" 3, 4 ,5") == [3, 4, 5]
  assert parse_token_ids("-2") == [-2]  # parsed; the range check (against the vocabulary) comes later
  with pytest.raises(ValueError, match=r"--prompt-ids: entry 1 is ''"):
    parse_token_ids("1,,2")
  with pytest.raises(ValueError, match=r"--ids: entry 1 is 'a'"):
    parse_token_ids("1,a", "--ids")
  with pytest.raises(ValueError, match=r"entry 0 is '1.5'"):
    parse_token_ids("1.5")


def test_sampling_parameters_must_be_finite_numbers_and_top_k_an_integer():
  from m3jax.sampling import SamplingParams
  SamplingParams(temperature=np.float32(0.7), top_k=np.int64(5), top_p=0.9)
  for bad in (float("nan"), float("inf"), -0.1, "0.7", True):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
      SamplingParams(temperature=bad)
  for bad in (2.5, -1, "5"):
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
      SamplingParams(temperature=1.0, top_k=bad)
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingParams(temperature=1.0, top_p=float("nan"))
