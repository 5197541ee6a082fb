"""FoT beside the FoT paper's baselines on the stdlib corpus, on CPU:

  python -m fot_jax.main --config=experiments/baselines_stdlib.py --workdir=runs/baselines

The tiny byte-level model of experiments/stdlib_lm_tiny.py (3 layers of 64, memory layer 1,
128-byte windows, 8 slots x 2 windows a step) trained five ways (fot_jax/runners/baselines.py): FoT
(crossbatch), the Memorizing Transformer (a memory of the same file's earlier windows, 1,024
entries per slot, attended in full in training, non-differentiable), Transformer-XL (every layer sees the previous
window), plain (no memory in training) and the hybrid (FoT, then its last HYBRID steps as the
Memorizing Transformer). One curriculum for all, shortened from stdlib_lm_tiny's to fit the
machine: the copy warm-up on byte ids until 95% (at most COPY_MAX steps), the copy of stdlib
text until 95% (at most TEXT_MAX), then LM steps on stdlib with a quarter of the slots
repeated and passkey documents beside the files (`stdlib_pk`). Every arm follows the phase
lengths FoT ran. Evaluation: perplexity of the last 512 bytes of held-out stdlib files against
0 .. 32K bytes of the same file before them (every memory arm with top-32 memory, like the
Memorizing Transformer's kNN; Transformer-XL through its own recurrence over the same bytes),
r_d and passkey per arm (seed 0); two seeds per arm. About 2.5 hours of 2 cores in all; the arms split
over processes and merge (docs/baselines.md).
"""
import ml_collections

from experiments import stdlib_lm_tiny

COPY_MAX, TEXT_MAX, LM = 2000, 300, 700
HYBRID = 150


def get_config():
  c = stdlib_lm_tiny.get_config()
  c.experiment = "baselines"
  phases = c.train.curriculum.phases
  phases[0]["max_steps"], phases[1]["max_steps"] = COPY_MAX, TEXT_MAX
  c.train.curriculum.phases = [phases[0], phases[1],
                               {"name": "lm", "task": "stdlib_pk", "spec": {"d": 8, "w": 1}, "steps": LM}]
  steps = COPY_MAX + TEXT_MAX + LM
  c.train.steps, c.optim.total_steps, c.train.checkpoint_every, c.train.log_every = steps, steps, 500, 50
  c.baseline.enabled = False  # the arms below replace the LM runner's one baseline
  c.baselines = ml_collections.ConfigDict({
      "arms": ("fot", "memorizing", "transformer_xl", "plain", "hybrid"),
      "seeds": (0, 1),
      # every arm on both seeds (an arm's seed 1 follows FoT's seed-1 phases); a cheaper run can
      # narrow this, e.g. ("fot", "memorizing") for the comparison the paper makes first
      "extra_seed_arms": ("fot", "memorizing", "transformer_xl", "plain", "hybrid"),
      # The Memorizing Transformer's training memory per slot: 1,024 entries (8 windows: as many
      # keys as FoT's d=8 crossbatch sees), attended in full (topk 0: kNN with k = all of it, exact;
      # top-32 training over 2,048 entries ran at 716 tok/s here, 6x slower than FoT, from
      # lax.top_k on CPU). Evaluation retrieves top-32 for every memory arm alike.
      "memory_tokens": 1024, "topk": 0,
      "hybrid_steps": HYBRID,
      "suites": ("rd", "passkey"),  # per arm, seed 0 (r_d: not for Transformer-XL, which has no memory)
      "rd": {"ds": (2, 8, 32), "n_docs": 32, "split": "train"},
      "passkey": {"lengths": (256, 512, 1024, 2048), "depths": (0.25, 0.75), "trials": 4}})
  c.eval.memory_tokens = (0, 2048, 8192, 32768)
  c.eval.mode, c.eval.topk = "topk", 32
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 512, 7, 8  # the 7 held-out files of 33K bytes
  return c


def get_test_config():
  """Seconds: stdlib_lm_tiny's test model, its LM phase for 2 steps, FoT and the hybrid, one seed, no suites."""
  t = stdlib_lm_tiny.get_test_config()
  c = get_config()
  c.model, c.data, c.warmup = t.model, t.data, t.warmup
  c.train.curriculum.phases = [dict(t.train.curriculum.phases[4], steps=2)]  # the LM phase alone
  c.train.steps, c.optim.total_steps, c.train.checkpoint_every, c.train.log_every = 2, 2, 0, 1
  c.baselines.seeds, c.baselines.hybrid_steps, c.baselines.memory_tokens = (0,), 1, 64
  c.baselines.arms, c.baselines.suites = ("fot", "hybrid"), ()  # the hybrid trains crossbatch and MT
  c.eval.memory_tokens, c.eval.score_tokens, c.eval.n_docs, c.eval.batch = (0, 64), 32, 2, 2
  return c
