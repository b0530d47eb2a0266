"""End-to-end studies: the top library layer (below only the command line).

A study trains runs with seeds (and a grid of varied keys), branches cooldowns
with constant-LR controls, writes weight averages, sweeps quantizers and
analyses over every checkpoint, writes the HTML report and computes a findings
table — each of the papers' claims with its measured effect, its uncertainty
and a verdict that follows from the numbers.

  spec.py      StudySpec: the typed, frozen study file (``quantdyn study FILE key=value ...``)
  scales.py    named sizes (``scale: pythia-160m``) applied to a spec before it is typed
  pipeline.py  run_study / run_demo: the stages, each resumable
  findings.py  pure functions: rows -> findings (effect, uncertainty parts, verdict)
  figures.py   the findings' own figures
  families.py  the finding families as registered objects (FINDING_FAMILIES): inputs, compute, figure,
               caption, words
  section.py   the answer (findings in sentences, a figure and a table) as the report's lead; write_report

Layering: this package may import every layer below it (config ... study,
report); only ``quantdyn.cli`` imports it.
"""
