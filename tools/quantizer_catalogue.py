"""Write quantdyn/quantize/catalogue.json from the quantizer registry: every built-in quantizer's name and format
spec, which `quantdyn` reads to parse and refuse a label without importing torch.

    python tools/quantizer_catalogue.py     # after adding or renaming a quantizer or a format

tests/test_quant_config.py fails while the file differs from the registry.
"""
import json

from quantdyn.quantize.catalogue import CATALOGUE_FILE, catalogue_of_registry


def catalogue_text() -> str:
    """The file's text: one quantizer a line, sorted by name."""
    entries = catalogue_of_registry()["quantizers"]
    lines = [f"  {json.dumps(name)}: {json.dumps(entries[name])}" for name in sorted(entries)]
    return ('{"about": "written by tools/quantizer_catalogue.py from quantdyn.quantize.catalogue.QUANTIZERS",\n'
            ' "quantizers": {\n' + ",\n".join(lines) + "\n}}\n")


if __name__ == "__main__":
    CATALOGUE_FILE.write_text(catalogue_text())
    print(f"wrote {CATALOGUE_FILE}")
