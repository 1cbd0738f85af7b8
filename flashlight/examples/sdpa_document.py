"""The document mask spelled as models spell attention: ``F.scaled_dot_product_attention`` with
a mask built from the document ids in the program. Flashlight traces the call as its softmax
program and fuses the mask (capture/sdpa.py): no N x N mask is built, and blocks of other
documents are skipped, as FlexAttention's ``mask_mod`` does."""
import torch
import torch.nn.functional as F

from .document_mask import make_inputs  # noqa: F401 — the same inputs: q, k, v, doc_ids


def attention(q, k, v, doc_ids):
    idx = torch.arange(q.shape[-2], device=q.device)
    mask = (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & (idx[:, None] >= idx[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
