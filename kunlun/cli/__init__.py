"""The console commands of pyproject.toml's [project.scripts] that train and evaluate:
``kunlun-train`` (train.py) and ``kunlun-eval`` (eval.py)."""
