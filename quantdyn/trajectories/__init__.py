"""Public training trajectories as data: one YAML file per model family and size (package data).

Read them with :mod:`quantdyn.study.presets` (``get_preset``); list them with ``quantdyn trajectories``.
Every number carries its source in a comment; what could not be verified is listed under ``unverified``
and unknown numbers are ``null``.
"""
