"""Moved to ``kunlun.serving.loader``; this alias goes in the next release."""
from kunlun._moved import alias

alias(__name__, "kunlun.serving.loader")
