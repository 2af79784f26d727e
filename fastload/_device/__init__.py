"""The only package that touches ``torch.cuda``."""

from fastload._device._copy_ahead import DevicePrefetcher
from fastload._device._cuda import cuda_available, cuda_device, to_device
from fastload._device._pin import PinnedSlots, pin_failure, pin_tree, pinned_slots

__all__ = [
    "DevicePrefetcher",
    "PinnedSlots",
    "cuda_available",
    "cuda_device",
    "pin_failure",
    "pin_tree",
    "pinned_slots",
    "to_device",
]
