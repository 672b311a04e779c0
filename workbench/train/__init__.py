"""Trainers for the shipped target (``target``) and EAGLE-3 draft heads (``eagle3``), and the
models the notebooks run on (``demo_models``: the shipped pair, else a micro pair built in
seconds)."""
