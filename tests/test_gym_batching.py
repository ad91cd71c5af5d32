"""The Gymnasium adapter's batched infos (gym._batch_infos) against VectorEnv._add_info, lane by lane.

The adapter's hot path builds the vector infos a key at a time when every
lane's info has the same keys and value types; whatever it batches must equal
what Gymnasium's own per-lane `_add_info` makes (keys and their order, masks,
dtypes, values), and whatever it cannot batch exactly it must decline.
No pools here: the adapter over real pools is tests/test_gym.py's.
"""

from __future__ import annotations

import numpy as np
from gymnasium.vector import VectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

from boltzlabs.gym import _batch_infos


class _Vec(VectorEnv):
    def __init__(self, n):
        self.num_envs = n


def gymnasium_infos(infos: list) -> dict:
    vec, out = _Vec(len(infos)), {}
    for i, info in enumerate(infos):
        out = vec._add_info(out, info, i)
    return out


def assert_equal_infos(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert type(got[key]) is type(want[key])
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert got[key].tobytes() == want[key].tobytes(), key


TYPED = [
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.floats(width=32, allow_nan=False).map(np.float32),
    st.floats(allow_nan=False).map(np.float64),
    st.integers(-100, 100).map(np.int64),
    st.integers(0, 200).map(np.uint8),
    st.lists(st.floats(-1, 1), min_size=2, max_size=2).map(np.array),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(np.array),
    st.text(max_size=3),
    st.booleans().map(np.bool_),
    st.none(),
]
values = st.one_of(*TYPED)


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.sampled_from(["a", "b", "reward_ctrl", "x_position", "final_obs"]), unique=True, max_size=4),
    n=st.integers(1, 6),
    same_types=st.booleans(),
    data=st.data(),
)
def test_batched_infos_equal_gymnasiums_or_are_declined(keys, n, same_types, data):
    if same_types:
        kinds = {key: data.draw(st.sampled_from(TYPED)) for key in keys}
        infos = [{key: data.draw(kinds[key]) for key in keys} for _ in range(n)]
    else:
        infos = [{key: data.draw(values) for key in data.draw(st.permutations(keys))} for _ in range(n)]
    batched = _batch_infos(infos, n)
    if batched is not None:
        assert_equal_infos(batched, gymnasium_infos(infos))


def test_a_real_envs_infos_are_batched():
    infos = [
        {
            "x_position": np.float64(i),
            "x_velocity": np.float64(-i),
            "reward_forward": np.float64(1.5),
            "reward_ctrl": np.float32(-0.25 * i),
        }
        for i in range(8)
    ]
    batched = _batch_infos(infos, 8)
    assert batched is not None
    assert_equal_infos(batched, gymnasium_infos(infos))
    assert batched["reward_ctrl"].dtype == np.float32


def test_what_it_cannot_batch_exactly_it_declines():
    assert _batch_infos([{"a": 1}, {"b": 1}], 2) is None  # keys some lanes lack
    assert _batch_infos([{"a": 1}, {"a": 1.0}], 2) is None  # mixed types
    assert _batch_infos([{"a": {"b": 1}}] * 2, 2) is None  # nested: lane by lane
    assert _batch_infos([{"a": "s"}] * 2, 2) is None  # objects
    assert _batch_infos([{"a": np.bool_(True)}] * 2, 2) is None  # not a np.number: Gymnasium makes objects
    assert _batch_infos([{"error": "x"}, {}], 2) is None
    assert _batch_infos([{}, {}], 2) == {}


def test_rows_of_one_batch_are_found_only_when_they_are_exactly_its_rows():
    from boltzlabs.gym import _rows_of_one_batch

    batch = np.empty((4, 2048), np.float32)  # as pool/slots.py makes each call's batch
    batch[...] = np.arange(4 * 2048).reshape(4, 2048)
    rows = [batch[i] for i in range(4)]
    assert _rows_of_one_batch(rows) is batch
    assert _rows_of_one_batch(rows[::-1]) is None  # out of order
    assert _rows_of_one_batch(rows[:3]) is None  # not every row
    assert _rows_of_one_batch([r.copy() for r in rows]) is None  # arrays of their own
    assert _rows_of_one_batch([batch[i, ::2] for i in range(4)]) is None  # strided views
    small = np.zeros((4, 3))
    assert _rows_of_one_batch([small[i] for i in range(4)]) is None  # small: stacked as before


def test_rows_are_stacked_in_one_call_only_into_exactly_the_batch_gymnasium_makes():
    from gymnasium import spaces
    from gymnasium.vector.utils import concatenate, create_empty_array

    from boltzlabs.gym import _stacked

    space = spaces.Box(-1, 1, (3,), np.float32)
    like = create_empty_array(space, n=4, fn=np.zeros)
    rows = [np.full(3, i, np.float32) for i in range(4)]
    stacked = _stacked(rows, like)
    want = concatenate(space, rows, create_empty_array(space, n=4, fn=np.zeros))
    assert stacked.dtype == want.dtype and stacked.shape == want.shape and stacked.tobytes() == want.tobytes()
    assert all(not np.shares_memory(stacked, row) for row in rows)  # a new array: the caller may keep it
    # Anything else goes to Gymnasium's concatenate, which casts (same_kind) or says what is wrong.
    assert _stacked([row.astype(np.float64) for row in rows], like) is None  # another dtype
    assert _stacked(rows[:3], like) is None  # a row short
    assert _stacked(rows[:3] + [np.zeros(4, np.float32)], like) is None  # ragged
    assert _stacked(rows[:3] + [None], like) is None  # not a number
