"""Adapters from a zephon :class:`~zephon.Pipeline` to training frameworks.

- :mod:`zephon.integrations.torch`: a ``torch.utils.data.IterableDataset`` of training tensors
  for ``DataLoader`` and torchdata's ``StatefulDataLoader`` (``pipeline.to_torch_dataset()``).
- :mod:`zephon.integrations.torchtitan`: ``ZephonDataLoader``, TorchTitan's data loader protocol.
- :mod:`zephon.integrations.lightning`: ``ZephonDataModule``, a Lightning ``LightningDataModule``.

Each module imports its framework lazily or on import of the module itself, never on
``import zephon``.
"""
