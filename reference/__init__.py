"""Slow, obviously-correct pure-PyTorch MoE layer that defines what mok computes."""
