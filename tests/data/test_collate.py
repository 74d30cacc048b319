"""The batch contract, with a per-sample text mask and no dead upstream keys."""

import pytest
import torch

from dzmodel.data.collate import Collator
from dzmodel.data.errors import DataError
from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _sample(prompt, K=2, H=3, S=5, A=4):
    return {"images": torch.zeros(9, 8, 16, 3, dtype=torch.uint8), "state": torch.rand(K, S),
            "action": torch.rand(K * H, A) * 2 - 1, "prompt": prompt, "embodiment_id": 21, "has_real_action": True}


def test_batch_contract(tokenizer):
    col = Collator(tokenizer, text_len=16, max_state_dim=8, max_action_dim=6)
    s1, s2 = _sample("pick up the red block and put it in the basket"), _sample("open drawer")
    b = col([s1, s2])
    assert set(b) == {"images", "state", "state_mask", "action", "action_mask", "text", "text_attention_mask",
                      "embodiment_id", "has_real_action"}
    assert b["images"].shape == (2, 9, 8, 16, 3) and b["images"].dtype == torch.uint8
    assert b["state"].shape == (2, 2, 8) and b["state_mask"][:, :, :5].all() and not b["state_mask"][:, :, 5:].any()
    assert b["action"].shape == (2, 6, 6) and b["action_mask"][..., :4].all() and not b["action_mask"][..., 4:].any()
    torch.testing.assert_close(b["action"][0, :, :4], s1["action"])
    assert (b["action"][..., 4:] == 0).all()
    lens = b["text_attention_mask"].sum(1)
    assert lens[0] > lens[1] >= 2  # each prompt keeps its own length
    assert b["text"].shape == (2, 16) and b["embodiment_id"].tolist() == [21, 21]


def test_collate_refuses_inconsistent_batches(tokenizer):
    col = Collator(tokenizer, text_len=16, max_state_dim=4, max_action_dim=6)
    with pytest.raises(DataError, match="max_state_dim"):
        col([_sample("a")])
    col = Collator(tokenizer, text_len=16, max_state_dim=8, max_action_dim=6)
    with pytest.raises(DataError, match="share"):
        col([_sample("a"), _sample("b", H=4)])
