"""The Hydra entry points, installed as `batchvlm.jobs` behind the console scripts (`batchvlm-embed`,
`batchvlm-estimate`, `batchvlm-status`, `batchvlm-report`, `batchvlm-verify`, `batchvlm-upgrade`, `batchvlm-bench`);
`python jobs/<job>.py` runs the same code."""
