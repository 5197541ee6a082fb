"""Sequence-parallel layouts and config checks (no devices needed). The attention itself on 8
fake CPU devices: tests/multidevice/context_parallel_cases.py (run by test_parallel.py)."""
import numpy as np
import pytest

from fot_jax.model import context_parallel as cp
from fot_jax.model.config import get_size


def _devices_tokens(t, n, layout):
  """Which original tokens each device holds, derived from the layouts' definitions."""
  c = t // n
  if layout == "contiguous":
    return [list(range(p * c, (p + 1) * c)) for p in range(n)]
  if layout == "striped":
    return [[i for i in range(t) if i % n == p] for p in range(n)]
  h = t // (2 * n)
  return [list(range(p * h, (p + 1) * h)) + list(range((2 * n - 1 - p) * h, (2 * n - p) * h)) for p in range(n)]


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_layout_permutation_places_tokens_and_round_trips(layout):
  t, n = 32, 4
  perm = cp.permutation(t, n, layout)
  c = t // n
  assert [perm[p * c:(p + 1) * c].tolist() for p in range(n)] == _devices_tokens(t, n, layout)
  # The runs the ring reasons with describe the same positions, device by device.
  for p in range(n):
    runs = cp._runs(layout, n, c, p)
    pos = np.concatenate([o + s * np.arange(length) for _, length, o, s in runs])
    np.testing.assert_array_equal(pos, perm[p * c:(p + 1) * c])
  x = np.arange(2 * t).reshape(2, t) * 10
  np.testing.assert_array_equal(cp.from_layout(cp.to_layout(x, perm), perm), x)


def test_causal_load_imbalance_matches_a_brute_force_count_and_the_section():
  """Unmasked scores per device from an explicit causal mask; the textbook section's figures
  for 8 devices (its cell: 256 tokens): contiguous 1.87, striped 1.03, zigzag 1.00."""
  t, n = 256, 8
  causal = np.tril(np.ones((t, t), bool))
  ratios = {}
  for layout in cp.LAYOUTS:
    brute = np.array([causal[tokens].sum() for tokens in _devices_tokens(t, n, layout)])
    np.testing.assert_array_equal(cp.work_counts(t, n, layout), brute)
    ratios[layout] = round(brute.max() / brute.mean(), 2)
  assert ratios == {"contiguous": 1.87, "striped": 1.03, "zigzag": 1.00}


def test_bad_settings_fail_naming_the_field():
  with pytest.raises(ValueError, match="model.context_parallel: must be one of"):
    get_size("tiny", context_parallel="rings")
  with pytest.raises(ValueError, match="model.context_layout: must be one of"):
    get_size("tiny", context_layout="zig")
  with pytest.raises(ValueError, match="data.window: 24 tokens do not split into 16 equal chunks for mesh.context=8"):
    cp.check_length(24, 8, "zigzag", "data.window")
  cp.check_length(24, 8, "striped")  # 8 chunks of 3
  with pytest.raises(ValueError, match="neither 1 kv heads nor 2 query heads per tensor shard split over mesh.context=4"):
    cp.check_heads("ulysses", 4, 2, 4, tensor=2)
  cp.check_heads("ulysses", 8, 2, 4, tensor=2)  # 4 query heads per shard, kv heads copied
  cp.check_heads("ring", 4, 2, 4, tensor=2)


def test_experiment_window_must_split_over_the_context_axis():
  from experiments import longllama_3b_32k
  from fot_jax import configs
  config = longllama_3b_32k.get_config()
  assert config.mesh.context == 8 and config.data.window == 32768
  config.data.window = 32768 - 8
  with pytest.raises(ValueError, match="data.window: 32760 tokens do not split into 16 equal chunks"):
    configs.resolve(config, check_data=False)
  config.data.window = 32768
  config.model.overrides.context_parallel = "ulysses"
  configs.resolve(config, check_data=False)  # 32 kv heads (MHA) / tensor=2: 16 per shard split over 8
  config.model.overrides.num_kv_heads, config.mesh.tensor, config.mesh.fsdp = 8, 8, 2
  with pytest.raises(ValueError, match="ulysses.*neither 1 kv heads nor 4 query heads per tensor shard"):
    configs.resolve(config, check_data=False)
