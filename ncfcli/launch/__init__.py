"""Several processes for one run: `ncf train DATA_DIR --nproc 2` (or `--gpus 8`, or torchrun).

- plan.py: how many workers, on which devices, with which environment;
- workers.py: start, watch and stop one node's workers, and report how they ended;
- environment.py: where each worker stands, read from its environment (torch-free);
- distributed.py: the process group and its collectives (an environment, not a mode: world
  size 1 runs the same code).
"""
