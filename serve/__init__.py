"""Serving: the continuous-batching engine (paged MLA cache, KDA state slots) and the batch
offline generation script. Imports kimik3; the model never imports serve."""
from .engine import Engine
from .request import Request, SamplingParams
from .pages import PageAllocator

__all__ = ["Engine", "Request", "SamplingParams", "PageAllocator"]
