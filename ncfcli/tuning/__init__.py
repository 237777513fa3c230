"""`ncf tune DATA_DIR --budget 20m | --trials N`: a search on the validation split.

- config.py: the options (TuneConfig), torch-free so `ncf tune --help` answers at once;
- space.py: what each trial may choose: the model kind and its settings;
- search.py: the Optuna study (TPE, Hyperband pruning on each epoch's validation HR@10) kept
  in the tune directory, the trials, the worker processes that share it, Ctrl-C, the budget;
- cost.py: how long a baseline's fit may take (one is never started past the deadline);
- report.py: the chosen trial as a normal run directory (its test set read once), the trials
  table, the parameter importances and the plot; `ncf inspect TUNE_DIR` prints it.
"""
