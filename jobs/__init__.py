"""The Hydra entry points, installed as `batchvlm.jobs` behind the console scripts (`batchvlm-embed`,
`batchvlm-report`, `batchvlm-verify`, `batchvlm-bench`); `python jobs/<job>.py` runs the same code."""
