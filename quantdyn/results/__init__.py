"""Result rows: the store (store.py) and tables over it (tables.py).

``quantdyn.results.load(store)`` -> pandas DataFrame, one row per stored row (see tables.py).
"""
from quantdyn.results.tables import load, to_parquet

__all__ = ["load", "to_parquet"]
