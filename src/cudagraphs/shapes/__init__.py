"""Many input sizes: bucket declarations and ladders, choosing a graph, bucketed and exact."""

from .bucket_stats import BucketStats
from .bucketed import Bucketed
from .exact import ExactShapes
from .ladders import powers_of_two, server_sizes, validate_ladder
from .spec import BUCKET_OPTIONS, Buckets

__all__ = [
    "BUCKET_OPTIONS",
    "BucketStats",
    "Bucketed",
    "Buckets",
    "ExactShapes",
    "powers_of_two",
    "server_sizes",
    "validate_ladder",
]
