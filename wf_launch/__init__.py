"""wf_launch: one command from a Hydra config to running ranks."""
