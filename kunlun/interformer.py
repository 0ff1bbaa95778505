"""Moved to ``kunlun.baselines.interformer``; this alias goes in the next release."""
from kunlun._moved import alias

alias(__name__, "kunlun.baselines.interformer")
