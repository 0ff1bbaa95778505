"""Moved to ``kunlun.serving.score``; this alias goes in the next release."""
from kunlun._moved import alias

alias(__name__, "kunlun.serving.score")
