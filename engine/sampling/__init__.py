"""Sampling on every rank: the sampler's pure tensor functions, the logits processors and xgrammar's grammar masks."""
