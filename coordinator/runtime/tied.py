"""Which parameters a plan ties across its stages: one Parameter that the nodes of several stages hold.

A model ties weights by using one ``nn.Parameter`` object in two places (GPT's token embedding
and output head). The model's chain (``services/compute/chain.py``) holds every tensor once,
under one name, with the nodes that use it (``Chain.holders``); :func:`shared_parameters` keeps
the parameters that more than one node holds. :func:`tied_per_stage` says, for a plan's stages
(node ranges), which of them each stage holds with which others. Every stage names a tensor as
the chain does, so a tied parameter has the same name on each holder and that name is also its
key. A parameter shared by nodes of one stage only is not tied across stages: that stage holds
one copy and autograd sums its uses. What the stages then do is [Note: tied parameters] in
``services/params/tied.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.compute.chain import Chain
from services.protocol import TiedParam

__all__ = ["Holders", "shared_parameters", "tied_per_stage"]

Holders = tuple[int, ...]  # the nodes holding a parameter, ascending


def shared_parameters(chain: Chain) -> dict[str, Holders]:
    """Each parameter that more than one node of ``chain`` holds: its name -> those nodes."""
    holders = chain.holders()
    return {name: holders[name] for name, _ in chain.named_parameters() if len(holders[name]) > 1}


def tied_per_stage(shared: Mapping[str, Holders], stages: Sequence[tuple[int, int]]) -> list[list[TiedParam]]:
    """For each stage (its node range ``[start, stop)``), the parameters it holds together with other stages.

    Raises:
        ValueError: A holding node is in no stage (``stages`` does not cover the model).
    """
    out: list[list[TiedParam]] = [[] for _ in stages]
    for name, nodes in shared.items():
        holding: set[int] = set()
        for node in nodes:
            found = [s for s, (start, stop) in enumerate(stages) if start <= node < stop]
            if not found:
                raise ValueError(f"node {node} (holding {name!r}) is in none of the stages {list(stages)}")
            holding.add(found[0])
        if len(holding) > 1:
            for s in sorted(holding):
                out[s].append(TiedParam(name=name, key=name, stages=sorted(holding)))
    return out
