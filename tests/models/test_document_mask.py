"""Document-level attention masking (`Llama.forward(tokens, documents=...)`): a document packed
after others in a row gives the logits it gives alone at the start of a row (the rotary scores
depend only on the offset between two positions), and without the mask it does not."""

import pytest
import torch

from moe.models import Llama, LlamaConfig
from moe.models.llama import document_ids

EOS = 127


def _dense():
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", moe=None)).eval()


def test_document_ids_count_the_end_of_text_in_the_document_it_ends():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, 9], [EOS, EOS, 1, 2, 3, 4]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]


def test_a_packed_document_sees_only_itself():
    model = _dense()
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, EOS, (1, 11), generator=gen)
    second = torch.randint(0, EOS, (1, 13), generator=gen)
    row = torch.cat([first, torch.tensor([[EOS]]), second], dim=1)  # (1, 25)
    with torch.no_grad():
        packed = model(row, documents=document_ids(row, EOS))
        causal = model(row)
        alone = model(second)
        first_alone = model(torch.cat([first, torch.tensor([[EOS]])], dim=1))
    torch.testing.assert_close(packed[:, 12:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, :12], first_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal[:, :12], packed[:, :12], rtol=1e-6, atol=1e-6)  # nothing earlier to hide
    assert (causal[:, 12:] - alone).abs().max() > 1e-2  # without the mask the first document is seen


def test_one_document_per_row_is_the_causal_model():
    model = _dense()
    tokens = torch.randint(0, EOS, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, documents=document_ids(tokens, EOS)), model(tokens))


def test_documents_of_the_wrong_shape_are_refused():
    model = _dense()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"documents must be \(B, S\) = \(2, 8\) integer ids, got \(2, 7\)"):
        model(tokens, documents=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids, got \\(2, 8\\) torch.float32"):
        model(tokens, documents=torch.zeros(2, 8))
