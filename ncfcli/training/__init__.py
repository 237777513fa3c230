"""Training, one file per step: `ncf train DATA_DIR [--out RUN_DIR]`.

- loop.py: `train` and the loop (`run_training`), the one function to read to know what a run
  does;
- config.py: the options (TrainConfig), their per-dataset defaults (`resolve`, `batch_lr`) and
  what --resume and --refit may change; defaults.py: the size table; recency.py: the recency
  weights and the validation probe that decides them;
- start.py: where a run starts from: resumed or new, the column of defaults (--recipe), the
  model and Adam, the data on the device; race.py: --recipe auto's race of two columns on a
  sample of the users, where the validation probe cannot choose (apart.py: one of its runs in
  a process of its own);
- session.py: the run's state while it trains (`Session`), built by start.py, updated by the loop;
- step.py: one optimizer step, an epoch's samples, the loss read, Ctrl-C;
- optim.py: the optimizer, the lr of each step (warm-up, decay), micro-batch gradients;
- validation.py: HR@10 and NDCG@10 on the validation split per epoch, and which epoch is the run's;
- run.py: what a run records of its training (TrainResult, the epochs' records), written by
  ncfcli/rundir/record.py;
- refit.py: --refit and the pretrained towers; baselines.py: the baselines' one-go fit;
- device.py: TF32, mixed precision, threads, out-of-memory errors; shard.py: the data over ranks.

config.py and defaults.py import no torch, so the CLI and the Python API read the options at once.
"""
