"""Hydra launcher ``wf_ray``: a ``-m`` sweep whose Ray points run side by side while the cluster has
room (docs/ray.md).

Laid out as ``wf_launch_slurm`` (and Hydra's own launcher plugins): :mod:`.config` only registers
the launcher's config node; :mod:`.wf_ray_launcher` holds the launcher class and imports
wf_launch only when a sweep is launched. Neither uses ``from __future__ import annotations``:
Hydra's plugin scanner executes them before they are in ``sys.modules``.
"""
