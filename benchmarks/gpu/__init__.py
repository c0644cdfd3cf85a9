"""The device check: one unattended run on a lent GPU (``check.sh``), its phases, their guard and their numbers."""
