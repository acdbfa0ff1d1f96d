"""Modules that replace matched ops, each calling a ``torch.library`` custom op."""
