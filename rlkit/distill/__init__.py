"""On-policy distillation: a student that samples, a frozen teacher that scores its tokens
(``loss``: the per-token reverse KL as advantage, and TRL's generalized JSD over the vocabulary)."""
