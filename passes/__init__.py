"""Graph passes, installed as ``fxlite.passes``: each pass is a function or class of its own file.

Typical compiler pipeline::

    ShapeProp(gm).propagate(*example_inputs)
    gm = decompose(normalize(gm))
    ShapeProp(gm).propagate(*example_inputs)
    fused = fuse(gm)
"""

from .attention import unpack_attention
from .cse import cse
from .decompose import DECOMPOSITIONS, decompose, register_decomposition
from .diff import GraphDiff, diff
from .draw import draw, to_dot
from .fold_constants import fold_constants
from .fold_conv_bn import fold_conv_bn
from .fuse import fuse
from .networkx import to_networkx
from .normalize import normalize, normalize_graph, produces_tensor
from .pass_manager import NumericsError, PassError, PassManager, PassRecord
from .shape_prop import ShapeProp, TensorMetadata, extract_tensor_metadata
from .sink_views import sink_views
from .split_by_tags import split_by_tags
from .split_module import split_module

__all__ = [
    "DECOMPOSITIONS",
    "GraphDiff",
    "NumericsError",
    "PassError",
    "PassManager",
    "PassRecord",
    "ShapeProp",
    "TensorMetadata",
    "cse",
    "decompose",
    "diff",
    "draw",
    "extract_tensor_metadata",
    "fold_constants",
    "fold_conv_bn",
    "fuse",
    "normalize",
    "normalize_graph",
    "produces_tensor",
    "register_decomposition",
    "sink_views",
    "split_by_tags",
    "split_module",
    "to_dot",
    "to_networkx",
    "unpack_attention",
]
