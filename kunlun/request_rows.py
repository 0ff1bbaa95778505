"""Moved to ``kunlun.serving.rows``; this alias goes in the next release."""
from kunlun._moved import alias

alias(__name__, "kunlun.serving.rows")
