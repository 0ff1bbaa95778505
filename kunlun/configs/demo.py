"""Demo preset (``scripts/demo.sh``): the tiny model, one pass over 400k fresh synthetic examples.

The ``tiny`` preset's 300 steps x 64 examples see ~20k examples: ~2.6k conversion-labelled rows,
split over three per-surface conversion heads, for a signal whose Bayes NE is 0.82-0.91. That ends
near NE 1 on conversion (heads still miscalibrated), and more passes over the same examples
memorise them. Here each example is seen once (``train.epochs = 1``, no overfitting, so no
validation / keep-best needed) and there are 20x more of them; generating them takes seconds.
Same model and schema as ``tiny``, so everything that trains ``tiny`` trains this. The data size
and learning rates follow the scaling ladder (``bench/results/scaling_ladder``): at 100k examples
and the default rates the demo was data-starved (click NE 0.76-0.77).
"""

from kunlun.configs import tiny


def get_config():
  c = tiny.get_config()
  c.data.num_examples = 400_000    # also the size scripts/demo.sh generates (DEMO_EXAMPLES)
  c.data.batch_size = 128
  c.train.epochs = 1.0             # one pass: 3125 steps at batch 128
  c.train.lr = 5e-3                # held-out choice at 3 of the ladder's 4 smaller Kunlun sizes
  c.train.emb_lr = 0.2             # row-wise Adagrad, as in the ladder
  c.train.checkpoint_every = 1000
  c.train.log_every = 250
  return c
