"""worldfoundry.core: the runtime library every rank uses.

:mod:`.distributed` holds the distributed runtime (topology, groups, CP/PP helpers, run
control), :mod:`.validation` the shared value checks, :mod:`.torch_private` every private torch
name the project uses. Import names from those modules (``from worldfoundry.core.distributed
import get_tp_group``); ``import worldfoundry.core`` itself imports nothing, so the launcher and
the tools can use :mod:`.validation` without torch.
"""
