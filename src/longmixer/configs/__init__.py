"""The Hydra config tree (`pkg://longmixer.configs`): train.yaml and its groups, shipped with the package."""
