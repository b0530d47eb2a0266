"""Result rows: what they hold (schema.py), their statistics and the verdict rule (stats.py), the store
(store.py) and tables over it (tables.py).

``quantdyn.results.load(store)`` -> pandas DataFrame, one row per stored row (see tables.py);
``quantdyn.results.schema.describe("delta_ce_total_se")`` says what a field means.
"""
from quantdyn.results.tables import load, to_parquet

__all__ = ["load", "to_parquet"]
