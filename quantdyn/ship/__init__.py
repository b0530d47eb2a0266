"""What to ship: the checkpoint, average and quantization to deploy at a size budget, decided on the quantized
model's held-out CE with its uncertainty, and written (``quantdyn ship``; ship/ship.py).

    candidates.py       a source -> the weights that could be deployed (checkpoints, EMA, LAWA, soups), by hash
    quantizations.py    the uniform types that fit the budget on this model, their export format, auto@BUDGET
    decide.py           pure decision logic: paired differences, the screen, the tied set, the naive choice
    ship.py             the command: screen, measure the survivors, decide, export, ship.json, rows
"""
