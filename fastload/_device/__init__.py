"""The only package that touches ``torch.cuda``."""

from fastload._device._cuda import cuda_available, cuda_device, to_device
from fastload._device._pin import page_lock, pin_tree
from fastload._device._prefetch import DevicePrefetcher

__all__ = ["DevicePrefetcher", "cuda_available", "cuda_device", "page_lock", "pin_tree", "to_device"]
