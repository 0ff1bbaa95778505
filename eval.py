"""``python eval.py``: the ``kunlun-eval`` command run from a checkout. The program, its flags
and the text ``--help`` prints are kunlun/cli/eval.py."""

from kunlun.cli.eval import main

if __name__ == "__main__":
  main()
