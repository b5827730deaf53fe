"""The text cells: a GPT of cells equals the same layers written by hand in torch, the block equals
torch's own encoder layer, the head ties to the embedding, and bad arguments name the cell."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from services.compute.cell import cell_parameters
from services.compute.library import MLP, LMHead, TokenEmbedding, TransformerBlock

VOCAB, WIDTH, HEADS, SEQ = 11, 8, 2, 6


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [TokenEmbedding("embed", VOCAB, WIDTH, SEQ), TransformerBlock("block0", WIDTH, HEADS),
            LMHead("head", WIDTH, VOCAB)]


def test_a_small_language_model_maps_ids_to_logits() -> None:
    net = nn.Sequential(*_model())
    ids = torch.randint(0, VOCAB, (3, 5))
    assert net(ids).shape == (3, 5, VOCAB)


def test_the_block_is_causal() -> None:
    """Changing a later token leaves every earlier position's output unchanged (and changes its own)."""
    net = nn.Sequential(*_model()).double()
    ids = torch.randint(0, VOCAB, (2, 6))
    later = ids.clone()
    later[:, 4] = (later[:, 4] + 1) % VOCAB
    a, b = net(ids), net(later)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=0)
    assert not torch.allclose(a[:, 4], b[:, 4])


def test_parameters_are_named_by_cell() -> None:
    names = [name for name, _ in cell_parameters(_model())]
    assert names[:2] == ["embed.pos", "embed.tok.weight"]  # own parameters first, as torch
    assert "block0.qkv.weight" in names and names[-1] == "head.out.bias"
    assert "block0.mlp.layers.0.weight" in names and "block0.norm2.bias" in names


class _HandWrittenGPT(nn.Module):
    """The GPT of ``_model(blocks)`` in plain torch, built in the cells' order; attention by its formula."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(WIDTH), "qkv": nn.Linear(WIDTH, 3 * WIDTH),
            "proj": nn.Linear(WIDTH, WIDTH), "norm2": nn.LayerNorm(WIDTH),
            "fc": nn.Linear(WIDTH, 4 * WIDTH), "out": nn.Linear(4 * WIDTH, WIDTH),
        }) for _ in range(blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos[:t]
        hd = WIDTH // HEADS
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).split(WIDTH, dim=-1)
            q, k, v = (z.view(b, t, HEADS, hd).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(future, float("-inf"))
            attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, WIDTH)
            x = x + blk["proj"](attn)
            x = x + blk["out"](F.gelu(blk["fc"](blk["norm2"](x))))
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def test_a_gpt_of_cells_equals_the_same_layers_written_by_hand() -> None:
    torch.manual_seed(4)
    cells = [TokenEmbedding("embed", VOCAB, WIDTH, SEQ),
             *(TransformerBlock(f"block{i}", WIDTH, HEADS) for i in range(2)), LMHead("head", WIDTH, VOCAB)]
    torch.manual_seed(4)
    reference = _HandWrittenGPT(2)
    ours = [p for _, p in cell_parameters(cells)]
    theirs = [reference.pos, reference.tok.weight, *[p for b in reference.blocks for p in b.parameters()],
              *reference.norm.parameters(), *reference.head.parameters()]
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    net = nn.Sequential(*cells).double()
    reference.double()
    ids = torch.randint(0, VOCAB, (3, SEQ))
    torch.testing.assert_close(net(ids), reference(ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_the_block_equals_torchs_pre_norm_encoder_layer(causal: bool) -> None:
    block = TransformerBlock("b", WIDTH, HEADS, mlp_ratio=1.5, causal=causal).double()
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=12, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True).double()
    ours = dict(block.module.named_parameters())
    renamed = {"self_attn.in_proj_weight": "qkv.weight", "self_attn.in_proj_bias": "qkv.bias",
               "self_attn.out_proj.weight": "proj.weight", "self_attn.out_proj.bias": "proj.bias",
               "linear1.weight": "mlp.layers.0.weight", "linear1.bias": "mlp.layers.0.bias",
               "linear2.weight": "mlp.layers.1.weight", "linear2.bias": "mlp.layers.1.bias"}
    layer.load_state_dict({k: ours[renamed.get(k, k)] for k in layer.state_dict()}, strict=True)
    layer.eval()  # the fast path of eval mode computes the same function
    x = torch.randn(2, 5, WIDTH, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64) if causal else None
    torch.testing.assert_close(block(x), layer(x, src_mask=mask, is_causal=causal), rtol=1e-10, atol=1e-10)


def test_block_dropout_acts_while_training_only() -> None:
    torch.manual_seed(5)
    dropped = TransformerBlock("b", WIDTH, HEADS, dropout=0.3)
    torch.manual_seed(5)
    plain = TransformerBlock("b", WIDTH, HEADS)
    x = torch.randn(2, 5, WIDTH)
    assert not torch.allclose(dropped(x), plain(x))
    dropped.eval()
    torch.testing.assert_close(dropped(x), plain(x), rtol=0, atol=0)


def test_rmsnorm_blocks_and_head_use_torchs_rmsnorm() -> None:
    block = TransformerBlock("b", WIDTH, HEADS, norm="rmsnorm", activation="silu")
    head = LMHead("h", WIDTH, VOCAB, norm="rmsnorm", bias=False)
    assert isinstance(block.module.norm1, nn.RMSNorm) and isinstance(head.module.norm, nn.RMSNorm)
    assert [n for n, _ in cell_parameters([head])] == ["h.norm.weight", "h.out.weight"]


def test_the_tied_head_shares_the_embeddings_table_and_sums_both_gradients() -> None:
    torch.manual_seed(6)
    embed = TokenEmbedding("embed", VOCAB, WIDTH, SEQ)
    tied = nn.Sequential(embed, LMHead("head", WIDTH, VOCAB, tie_to=embed, bias=False)).double()
    assert tied[1].module.out.weight is embed.token_weight
    names = [n for n, _ in cell_parameters(list(tied))]
    assert names == ["embed.pos", "embed.tok.weight", "head.norm.weight", "head.norm.bias"]  # once
    state = tied.state_dict()  # the unwrapped model's keys: the tied table under both
    assert state["0.module.tok.weight"].data_ptr() == state["1.module.out.weight"].data_ptr()
    # the same function with two separate copies: the tied gradient is the sum of the copies'
    torch.manual_seed(6)
    e2 = TokenEmbedding("embed", VOCAB, WIDTH, SEQ)
    h2 = LMHead("head", WIDTH, VOCAB, bias=False)
    untied = nn.Sequential(e2, h2).double()
    untied.load_state_dict(tied.state_dict())
    h2.module.out.weight.data = embed.token_weight.data.clone()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    tied(ids).square().mean().backward()
    untied(ids).square().mean().backward()
    grad = embed.token_weight.grad
    assert grad is not None and e2.token_weight.grad is not None and h2.module.out.weight.grad is not None
    torch.testing.assert_close(grad, e2.token_weight.grad + h2.module.out.weight.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TransformerBlock("b", 10, 3), "TransformerBlock 'b': heads=3 does not divide width=10"),
    (lambda: TransformerBlock("b", 8, 2, mlp_ratio=0.1),
     "TransformerBlock 'b': mlp_ratio must be a number .* got mlp_ratio=0.1 with width=8"),
    (lambda: TransformerBlock("b", 8, 2, norm="batch"), "TransformerBlock 'b': norm must be one of"),
    (lambda: TransformerBlock("b", 8, 2, dropout=-1), "TransformerBlock 'b': dropout must be a probability"),
    (lambda: TokenEmbedding("e", 0, 8, 4), "TokenEmbedding 'e': vocab must be a positive integer, got 0"),
    (lambda: TokenEmbedding("e", 8, 8, "4"), "TokenEmbedding 'e': max_seq must be a positive integer, got '"),
    (lambda: LMHead("h", 8, -1), "LMHead 'h': vocab must be a positive integer, got -1"),
    (lambda: LMHead("h", 8, 11, tie_to=TokenEmbedding("e", 12, 8, 4)),
     "LMHead 'h': tie_to='e' has a 12 x 8 token table, the head maps width 8 to vocab 11"),
    (lambda: LMHead("h", 8, 11, tie_to=MLP("m", [8, 11])), "LMHead 'h': tie_to must be a TokenEmbedding"),
])
def test_bad_arguments_are_refused_naming_the_cell_and_the_argument(build: Callable[[], object],
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_a_sequence_longer_than_max_seq_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than max_seq=6"):
        _model()[0](torch.zeros(1, 7, dtype=torch.long))
