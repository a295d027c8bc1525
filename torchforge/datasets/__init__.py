"""Map-style datasets over shard folders, one module per format, and :func:`open_dataset`."""
from torchforge.datasets.base import ShardDataset, formats, open_dataset, register_format

__all__ = ["ShardDataset", "formats", "open_dataset", "register_format"]
