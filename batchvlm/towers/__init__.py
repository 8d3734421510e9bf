"""What every family's vision tower runs on beside its weights: attention over a packed batch with no padding
(attention.py) and the inputs a tower computes from its images' grids, built once per grid (grids.py)."""
