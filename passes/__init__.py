"""Graph passes, installed as ``fxlite.passes``: each pass is a function or class of its own file."""

from .shape_prop import ShapeProp, TensorMetadata, extract_tensor_metadata

__all__ = [
    "ShapeProp",
    "TensorMetadata",
    "extract_tensor_metadata",
]
