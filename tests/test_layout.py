import pytest

from sparse_dsa_ops import KCacheLayout


@pytest.mark.parametrize(
    "row_bytes, d_nope, d_rope",
    [(656, 512, 64), (264, 256, 0), (528, 512, 0), (392, 256, 64), (132, 128, 0), (260, 128, 64), (1056, 1024, 0)],
)
def test_from_row_bytes(row_bytes, d_nope, d_rope):
    lay = KCacheLayout.from_row_bytes(row_bytes)
    assert (lay.d_nope, lay.d_rope) == (d_nope, d_rope)
    assert lay.row_bytes == row_bytes


@pytest.mark.parametrize("row_bytes", [0, 1, 128, 576, 600, 655, 657, 1000, -264])
def test_from_row_bytes_rejects(row_bytes):
    with pytest.raises(ValueError, match="nearest valid widths are") as info:
        KCacheLayout.from_row_bytes(row_bytes)
    assert str(row_bytes) in str(info.value)


def test_rejection_lists_the_closest_widths():
    with pytest.raises(ValueError) as info:
        KCacheLayout.from_row_bytes(650)
    assert "656 (512+64)" in str(info.value) and "660 (640+0)" in str(info.value)


def test_offsets_deepseek():
    lay = KCacheLayout(512, 64)
    assert (lay.nope_offset, lay.scale_offset, lay.rope_offset, lay.row_bytes) == (0, 512, 528, 656)
    assert (lay.num_scales, lay.d_qk) == (4, 576)


def test_offsets_glm():
    lay = KCacheLayout(256, 0)
    assert (lay.nope_offset, lay.scale_offset, lay.rope_offset, lay.row_bytes) == (0, 256, 264, 264)
    assert (lay.num_scales, lay.d_qk) == (2, 256)


@pytest.mark.parametrize("d_nope, d_rope", [(0, 0), (100, 0), (-128, 0), (256, -64), (256.0, 0)])
def test_constructor_rejects(d_nope, d_rope):
    with pytest.raises(ValueError):
        KCacheLayout(d_nope, d_rope)


def test_inference_is_unique():
    seen = {}
    for d_nope in range(128, 4097, 128):
        for d_rope in (0, 64):
            lay = KCacheLayout(d_nope, d_rope)
            assert lay.row_bytes not in seen
            seen[lay.row_bytes] = lay
            assert KCacheLayout.from_row_bytes(lay.row_bytes) == lay
