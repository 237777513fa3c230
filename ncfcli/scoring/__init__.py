"""Scoring a model's rankings: HR@K and NDCG@K over sampled negatives or every item (metrics.py).

Training's per-epoch validation and `ncf eval` / `ncf recommend` / `ncf export` use the same code.
"""
