"""Sizing a job before it runs (estimate.py, behind `batchvlm-estimate`): above the executor, whose workers' steps
and row assembly it runs on a sample, and the loader, whose memory it predicts."""
