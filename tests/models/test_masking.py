import torch

from mae.models.masking import gather_tokens, num_visible, random_masking


def _reference(noise, mask_ratio):
    """The official/transformers random_masking, verbatim in its index logic."""
    n, length = noise.shape
    len_keep = int(length * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    mask = torch.ones([n, length])
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, dim=1, index=ids_restore)
    return ids_keep, ids_restore, mask


def test_matches_reference_semantics():
    noise = torch.rand(5, 49)
    for ratio in (0.0, 0.5, 0.75, 0.9):
        ours = random_masking(noise, ratio)
        ref = _reference(noise, ratio)
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)


def test_noise_determines_mask_and_smallest_are_kept():
    noise = torch.rand(3, 16)
    m = random_masking(noise, 0.75)
    assert m.ids_keep.shape == (3, num_visible(16, 0.75)) == (3, 4)
    assert torch.equal(m.mask.sum(1), torch.full((3,), 12.0))
    # the kept patches are exactly the 4 with the smallest noise
    smallest = noise.topk(4, dim=1, largest=False).indices.sort(1).values
    assert torch.equal(m.ids_keep.sort(1).values, smallest)
    assert torch.equal(m.mask.gather(1, m.ids_keep), torch.zeros(3, 4))
    assert torch.equal(random_masking(noise.clone(), 0.75).mask, m.mask)


def test_restore_undoes_shuffle():
    x = torch.randn(2, 10, 4)
    noise = torch.rand(2, 10)
    m = random_masking(noise, 0.0)
    shuffled = gather_tokens(x, m.ids_keep)
    assert torch.equal(gather_tokens(shuffled, m.ids_restore), x)
