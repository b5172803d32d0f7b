"""gpufeed: packed datasets that keep the GPU fed."""

from gpufeed._version import __version__

__all__ = ["__version__"]
