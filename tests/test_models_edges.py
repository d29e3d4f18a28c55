"""Model inputs at the edges: token ids outside the vocabulary, mismatched batches."""

import pytest
import torch

import addnorm as an
from addnorm.model import EncoderDecoder


def _cfg(**kw) -> an.TransformerConfig:
    base = {"d_model": 8, "n_heads": 2, "d_ff": 16, "n_layers": 1, "dropout": 0.0}
    return an.TransformerConfig(**{**base, **kw})


def test_language_model_names_a_token_id_outside_the_vocabulary():
    lm = an.LanguageModel(_cfg(), 20)
    assert lm(torch.tensor([[0, 19]])).shape == (1, 2, 20)  # both ends of the vocabulary are fine
    for bad in (20, 1000, -1):
        expected = rf"^tokens: token id {bad} is outside the vocabulary of 20 ids \(vocab=20"
        with pytest.raises(ValueError, match=expected):
            lm(torch.tensor([[3, bad, 4]]))


def test_transformer_names_the_argument_and_its_vocabulary():
    model = an.Transformer(_cfg(), 10, 30)
    ok_src, ok_tgt = torch.tensor([[9, 0]]), torch.tensor([[29, 0, 1]])
    assert model(ok_src, ok_tgt).shape == (1, 3, 30)
    with pytest.raises(ValueError, match=r"^src: token id 12 .* \(src_vocab=10: expected 0 <= id < 10\)$"):
        model(torch.tensor([[12, 0]]), ok_tgt)
    with pytest.raises(ValueError, match=r"^tgt: token id 30 .* \(tgt_vocab=30: expected 0 <= id < 30\)$"):
        model(ok_src, torch.tensor([[30]]))
    with pytest.raises(ValueError, match=r"^tgt_vocab: expected a positive int, got 0$"):
        an.Transformer(_cfg(), 10, 0)


def test_encoder_decoder_rejects_mismatched_batches():
    model = EncoderDecoder(_cfg())
    with pytest.raises(ValueError, match=r"^tgt: batch size 3 must equal src's 2"):
        model(torch.randn(2, 5, 8), torch.randn(3, 4, 8))
    assert model(torch.randn(2, 5, 8), torch.randn(2, 4, 8)).shape == (2, 4, 8)
