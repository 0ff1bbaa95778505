"""Serving (spec d.6): score one user's request against N candidate ads.

* ``score.py``: request-level scoring, ``make_scorer`` (the request's work runs once and is
  broadcast to its ads; ``pack_requests``: request histories packed back to back), what is
  shared (``sharing_plan``) and its FLOPs (``flops_split``);
* ``rows.py``: the request-row values (``PerRequest``) the Kunlun trunk carries on that path;
* ``export.py``: ``python -m kunlun.serving.export``, a trained run as a ``jax.export`` artifact;
* ``loader.py``: runs that artifact with jax and numpy only (no model code; one file to copy).

Importing this package loads none of them.
"""
