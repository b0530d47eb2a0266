"""``python -m quantdyn`` runs the console script."""
from quantdyn.cli import main

main()
