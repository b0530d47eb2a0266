"""``python -m quantdyn.cli`` (what torchrun and the tests launch)."""
from quantdyn.cli import main

main()
