"""Kunlun / GEM ranking model as pure-functional Flax Linen modules."""
