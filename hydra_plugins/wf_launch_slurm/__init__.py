"""Hydra launcher ``wf_slurm``: a ``-m`` sweep whose SLURM points go to SLURM at once.

See docs/slurm.md.

Laid out as Hydra's own launcher plugins are: :mod:`.config` only registers the
launcher's config node; :mod:`.wf_slurm_launcher` holds the launcher class and
imports wf_launch only when a sweep is launched. Hydra's plugin scanner executes
these modules before they are in ``sys.modules``, so neither uses
``from __future__ import annotations`` (a dataclass could not resolve its module).
"""
