"""The run directory, what `ncf train` leaves and every later command reads.

- checkpoint.py: best.pt / last.pt and config.json, written atomically, loaded without pickles;
- logs.py: train.log, TensorBoard and MLflow beside the checkpoints;
- eval_record.py: eval.json, what `ncf eval` found.
"""
