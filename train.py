"""``python train.py``: the ``kunlun-train`` command run from a checkout. The program, its flags
and the text ``--help`` prints are kunlun/cli/train.py."""

from kunlun.cli.train import main

if __name__ == "__main__":
  main()
