"""The engines that prepare a dataset: choose.py picks one for the input's size, dask.py runs on
a Dask cluster (cluster.py starts a local one or joins the user's).
"""
