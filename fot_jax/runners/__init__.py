"""The experiments `fot_jax.main` runs, each from a resolved `configs.Experiment`:

  dictionary  the dictionary-lookup experiment (the demo): FoT and its baseline, accuracy against
              memory size, r_d
  lm          an LM experiment: FoT (and the no-crossbatch arm) on SeqIO/text slot batches,
              perplexity against memory size
  baselines   the FoT paper's comparison on one LM run (Memorizing Transformer, Transformer-XL,
              plain, hybrid), and the merge of split runs (python -m fot_jax.runners.baselines)
  common      what they share: training one arm, the following arms' schedule, results and tables
  lm_data     an LM experiment's batch sources, one per typed curriculum feed

lm, lm_data and baselines read SeqIO data (TensorFlow); dictionary and common do not.
"""
