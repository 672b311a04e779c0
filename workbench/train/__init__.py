"""Trainers for the shipped target (``target``) and EAGLE-3 draft heads (``eagle3``)."""
