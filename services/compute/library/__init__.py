"""Ready-made cells: the pieces most models are assembled from, each a :class:`~services.compute.cell.Cell`.

A model is a list of cells run one after the other (see :mod:`services.compute.cell`), cut
into pipeline stages only between cells. The library, by family:

* :mod:`~services.compute.library.common`: :class:`MLP`, :class:`Norm` (LayerNorm or
  RMSNorm by name), :class:`Dropout`;
* :mod:`~services.compute.library.text`: :class:`TokenEmbedding` (tokens plus learned
  positions), :class:`TransformerBlock` (pre-norm, causal or not, MLP ratio, dropout),
  :class:`LMHead` (optionally tied to an embedding's token table);
* :mod:`~services.compute.library.vision`: :class:`ConvBlock` (conv, norm, activation),
  :class:`ResidualBlock` (basic block, projection skip), :class:`ClassifierHead` (pooling, linear).

Every cell takes its name first, then its sizes, then keyword options; a bad argument is a
``ValueError`` naming the cell and the argument (:mod:`~services.compute.library.checks`).
Each cell's parameters are named ``"{cell name}.{parameter}"``, so a checkpoint of a model
built from them loads into ``nn.Sequential(*model)``; ``examples/gpt.py`` and
``examples/resnet.py`` are whole jobs built from them.
"""

from services.compute.library.common import MLP, Dropout, Norm
from services.compute.library.text import LMHead, TokenEmbedding, TransformerBlock
from services.compute.library.vision import ClassifierHead, ConvBlock, ResidualBlock

__all__ = ["MLP", "ClassifierHead", "ConvBlock", "Dropout", "LMHead", "Norm", "ResidualBlock",
           "TokenEmbedding", "TransformerBlock"]
