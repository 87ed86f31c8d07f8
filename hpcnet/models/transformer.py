"""A decoder-only (GPT-style) transformer language model."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpcnet.data.info import DatasetInfo
from hpcnet.errors import ConfigError
from hpcnet.models.options import boolean, optional_positive_int, positive_int, probability, require_kind


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        """Build the layer.

        Args:
            d_model: model width; must be divisible by ``n_heads``.
            n_heads: number of attention heads.
            dropout: dropout on attention weights and on the output projection.
        """
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``[B, T, d_model]``."""
        batch, seq_len, d_model = x.shape
        # [B, T, 3, H, D] -> three tensors of [B, H, T, D], the layout SDPA expects.
        q, k, v = self.qkv(x).view(batch, seq_len, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out = out.transpose(1, 2).reshape(batch, seq_len, d_model)
        return self.proj_dropout(self.proj(out))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        """Build the block.

        Args:
            d_model: model width.
            n_heads: number of attention heads.
            d_ff: hidden width of the feed-forward layer.
            dropout: dropout probability.
        """
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff_in = nn.Linear(d_model, d_ff)
        self.ff_out = nn.Linear(d_ff, d_model)
        self.ff_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[B, T, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.ff_dropout(self.ff_out(F.gelu(self.ff_in(self.ln2(x)))))


class TransformerLM(nn.Module):
    """GPT-style causal language model: token + learned position embeddings, blocks, LM head."""

    def __init__(
        self, *, vocab_size: int, max_seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
        dropout: float, tie_weights: bool,
    ):
        """Build the model.

        Args:
            vocab_size: number of token ids.
            max_seq_len: longest sequence the position embedding covers.
            d_model: model width.
            n_layers: number of transformer blocks.
            n_heads: attention heads per block.
            d_ff: feed-forward hidden width.
            dropout: dropout probability.
            tie_weights: share the token embedding with the output projection.
        """
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, d_ff, dropout) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # GPT-2 initialisation: N(0, 0.02), with residual projections scaled down by
        # sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.attn.proj, block.ff_out):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, T]`` to next-token logits ``[B, T, vocab_size]``."""
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def transformer(
    info: DatasetInfo, *, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, d_ff: int | None = None,
    dropout: float = 0.0, max_seq_len: int | None = None, tie_weights: bool = True,
) -> TransformerLM:
    """Build a small decoder-only language model for token data.

    Args:
        info: the dataset; must be token data, ``num_classes`` is the vocabulary size.
        d_model: model width.
        n_layers: number of blocks.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: feed-forward hidden width; None means ``4 * d_model``.
        dropout: dropout probability.
        max_seq_len: longest sequence; None means the dataset's sequence length.
        tie_weights: share the token embedding with the output projection.
    """
    require_kind(info, "tokens", "transformer")
    d_model = positive_int(d_model, "d_model")
    n_heads = positive_int(n_heads, "n_heads")
    if d_model % n_heads:
        raise ConfigError(f"model.options.n_heads: {n_heads} does not divide d_model {d_model}")
    d_ff = optional_positive_int(d_ff, "d_ff")
    max_seq_len = optional_positive_int(max_seq_len, "max_seq_len")
    return TransformerLM(
        vocab_size=info.num_classes,
        max_seq_len=info.input_shape[0] if max_seq_len is None else max_seq_len,
        d_model=d_model,
        n_layers=positive_int(n_layers, "n_layers"),
        n_heads=n_heads,
        d_ff=4 * d_model if d_ff is None else d_ff,
        dropout=probability(dropout, "dropout"),
        tie_weights=boolean(tie_weights, "tie_weights"),
    )
