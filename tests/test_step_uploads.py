"""`StepUploads` (weft/arrays.py): a step's host arrays in one copy. On a CUDA GPU where there is
one; else with the CPU standing in for the device (the same buffers, a plain copy)."""

from __future__ import annotations

import numpy as np
import torch

from weft.arrays import StepUploads

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_arrays_of_every_dtype_land_after_one_send():
    uploads = StepUploads(DEVICE, capacity=256)
    put = uploads.begin()
    arrays = [
        np.arange(5, dtype=np.int64),
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),  # a block table
        np.array([], dtype=np.int64),
        np.array([0.5, -2.0], dtype=np.float32),
        np.array([[True, False]], dtype=np.bool_),
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, :2],  # not contiguous
    ]
    views = [put(a) for a in arrays]
    uploads.send()
    for array, view in zip(arrays, views, strict=True):
        assert view.device.type == DEVICE.type and view.shape == array.shape
        assert np.array_equal(view.cpu().numpy(), array)


def test_a_step_bigger_than_the_buffer_grows_it_and_keeps_what_was_put():
    uploads = StepUploads(DEVICE, capacity=64)
    put = uploads.begin()
    first = put(np.arange(6, dtype=np.int64))  # 48 bytes
    second = put(np.arange(100, dtype=np.int64))  # does not fit: the first goes, then a bigger buffer
    uploads.send()
    assert first.tolist() == list(range(6)) and second.tolist() == list(range(100))
    assert uploads.slot.capacity >= 800


def test_the_ring_reuses_buffers_without_touching_a_step_in_flight():
    uploads = StepUploads(DEVICE, capacity=1024, ring=2)
    seen = []
    for step in range(5):
        put = uploads.begin()
        seen.append((step, put(np.full(4, step, dtype=np.int64))))
        uploads.send()
        previous_step, previous = seen[-2] if len(seen) > 1 else seen[-1]
        assert previous.tolist() == [previous_step] * 4  # the other slot's data is intact
