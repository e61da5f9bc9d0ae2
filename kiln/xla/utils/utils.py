"""``torch_xla.utils.utils`` on kiln: ``SampleGenerator``, the synthetic-data loader of
torch_xla's example scripts (``--fake_data``)."""
from __future__ import annotations


class SampleGenerator:
    """Yields ``data`` ``sample_count`` times, like a DataLoader of one repeated batch;
    each ``iter()`` starts again."""

    def __init__(self, data, sample_count: int):
        self._data, self._count = data, int(sample_count)

    def __iter__(self):
        return (self._data for _ in range(self._count))

    def __len__(self):
        return self._count
