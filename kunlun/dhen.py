"""Moved to ``kunlun.baselines.dhen``; this alias goes in the next release."""
from kunlun._moved import alias

alias(__name__, "kunlun.baselines.dhen")
