"""The Hydra configs, installed as `batchvlm.conf` (pyproject.toml maps the folder) and read as
`pkg://batchvlm.conf`, so the jobs find them from a checkout and from an installed wheel alike."""
