"""From a run directory to figures and served models.

- evaluation.py: `ncf eval` (sampled and full ranking);
- recommendation.py: `ncf recommend` (top-K raw item ids, for some users or all);
- onnx_export.py, onnx_graph.py, triton.py: `ncf export --onnx [--triton DIR]`;
- inspect.py: `ncf inspect` (what a dataset, run or tune directory holds).
"""
