"""The pieces of remote reading and resume that need no server: the shuffle replay a resume seeks
with, the read settings, the backoff."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import ConfigError, DataCfg, load_config
from pipeline.data.augment import replay_shuffle, shuffle_buffer
from pipeline.data.stream import ReadPolicy


@pytest.mark.parametrize("size", [2, 3, 8, 100])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 57])
def test_replay_shuffle_continues_the_shuffle_exactly(n, size):
    """After emitting ``skip`` items (every skip, in the fill phase and in the drain), the replayed
    buffer and generator state continue with exactly the rest of the uninterrupted shuffle."""
    full = list(shuffle_buffer(iter(range(n)), size, np.random.default_rng(7)))
    assert sorted(full) == list(range(n))
    for skip in range(n + 1):
        rng = np.random.default_rng(7)
        buf, nxt, drained = replay_shuffle(n, size, rng, skip)
        assert nxt == min(n, max(size, skip + size) if n > size else n)
        rest = buf if drained else list(shuffle_buffer(iter(range(nxt, n)), size, rng, buf=list(buf)))
        assert rest == full[skip:], skip


def test_read_settings_defaults_limits_and_one_line_errors():
    d = DataCfg()
    assert (d.read_timeout_s, d.read_retries, d.on_read_error) == (60.0, 5, "skip")
    assert ReadPolicy.of(d) == ReadPolicy(60.0, 5, "skip")
    assert ReadPolicy.of(DataCfg(read_timeout_s=2, read_retries=0, on_read_error="stop")) == ReadPolicy(2.0, 0, "stop")
    for bad, key in (("data.on_read_error=maybe", "data.on_read_error"), ("data.read_retries=-1", "data.read_retries"),
                     ("data.read_timeout_s=0", "data.read_timeout_s")):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model.name=vit_ti16", bad], world_size=1)
        assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_backoff_doubles_is_capped_and_jittered():
    p = ReadPolicy(backoff_s=0.25, backoff_cap_s=10.0)
    waits = [[p.backoff(k) for k in range(1, 10)] for _ in range(50)]
    for k in range(1, 10):
        base = min(10.0, 0.25 * 2 ** (k - 1))
        got = [w[k - 1] for w in waits]
        assert all(base / 2 <= x <= base for x in got) and len(set(got)) > 1  # jitter: not in step


def test_a_signed_address_is_tracked_without_its_secret():
    from pipeline.data.loader import ShardSource

    src = ShardSource("https://data.example.org/sets/shards?X-Amz-Signature=secret&X-Amz-Credential=k")
    assert src.source_fields() == {"uri": "https://data.example.org/sets/shards"}
    assert src.dataset_name() == "shards"
    assert ShardSource("s3://bucket/ds/").dataset_name() == "ds"
