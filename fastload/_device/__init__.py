"""The only package that touches ``torch.cuda``."""

from fastload._device._pin import pin_tree

__all__ = ["pin_tree"]
