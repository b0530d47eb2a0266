"""Packages absent, on purpose: with this folder first on PYTHONPATH, every top-level module named in
$QUANTDYN_ABSENT_MODULES (comma-separated) is unimportable in this interpreter and in every child it starts
(they inherit PYTHONPATH), as on a GPU machine that lacks them (tools/gpu_bundle.py absent).

``sys.modules[name] = None`` is what Python itself uses for "not importable": ``import name`` raises
ModuleNotFoundError and ``importlib.util.find_spec(name)`` returns None, so libraries that probe for an optional
package (transformers does, at import) see it missing rather than crash. A test helper, not part of quantdyn: this
file exists to have this one side effect at interpreter start.
"""
import os
import sys

for _name in filter(None, os.environ.get("QUANTDYN_ABSENT_MODULES", "").split(",")):
    sys.modules[_name] = None
