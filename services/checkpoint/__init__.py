"""Checkpoints: DCP storage written in parts (``dcp``), a stage's training state (``stage_state``), the
background writer (``writer``)."""
