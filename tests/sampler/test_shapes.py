from mmgrpo_jax.sampler.shapes import cache_bucket, row_bucket, token_bucket


def test_buckets_are_powers_of_two_then_multiples_past_the_granule():
    assert [row_bucket(n) for n in (1, 3, 8, 9, 48, 50)] == [1, 4, 8, 16, 48, 56]
    assert [token_bucket(n) for n in (1, 17, 512, 513, 6144)] == [16, 32, 512, 1024, 6144]
    assert [cache_bucket(n) for n in (0, 1, 128, 129, 8192)] == [128, 128, 128, 256, 8192]


def test_row_buckets_round_up_to_the_mesh_batch_devices():
    assert [row_bucket(n, multiple=8) for n in (1, 3, 9, 48)] == [8, 8, 16, 48]
    assert row_bucket(3, multiple=6) == 6
